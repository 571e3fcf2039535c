"""Kaggle credentials, the hosts downloads come from, and kagglehub's offline copies: what the
model loader (models/kaggle.py) and the data sources (data/hub.py) check in seconds, before
anything downloads. A credential's value is never returned, printed or logged:
`credential_source` names where one is, `scrub` blanks every one in a text.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
from urllib.parse import urlsplit

from reasoner.errors import ConfigError

NO_CREDENTIALS = ("no Kaggle credentials were found: set KAGGLE_USERNAME and KAGGLE_KEY (or "
                  "KAGGLE_API_TOKEN), write ~/.kaggle/kaggle.json "
                  '({"username": ..., "key": ...}), or add them as Kaggle notebook secrets')


class CredentialsError(ConfigError):
  """kaggle.json is there but unusable (its values are never shown)."""


def credential_source() -> str | None:
  """Where kagglehub will find credentials (a name, never a value), or None. Kaggle notebook
  secrets KAGGLE_USERNAME / KAGGLE_KEY are handed to kagglehub in memory."""
  if os.environ.get("KAGGLE_API_TOKEN"):
    return "KAGGLE_API_TOKEN"
  if os.environ.get("KAGGLE_USERNAME") and os.environ.get("KAGGLE_KEY"):
    return "KAGGLE_USERNAME/KAGGLE_KEY"
  folder = pathlib.Path(os.environ.get("KAGGLE_CONFIG_DIR", pathlib.Path.home() / ".kaggle"))
  if (folder / "kaggle.json").is_file():
    _check_json(folder / "kaggle.json")
    return str(folder / "kaggle.json")
  for name in ("access_token", "access_token.txt"):
    if (pathlib.Path.home() / ".kaggle" / name).is_file():
      return f"~/.kaggle/{name}"
  if _notebook_secrets():
    return "Kaggle notebook secrets"
  return None


def _check_json(path: pathlib.Path) -> None:
  """kaggle.json must be a JSON object with 'username' and 'key' (its values are never shown)."""
  try:
    data = json.loads(path.read_text())
  except (OSError, ValueError):
    raise CredentialsError(f"{path} is not valid JSON; expected "
                           '{"username": "...", "key": "..."} from kaggle.com/settings') from None
  for k in ("username", "key"):
    if not isinstance(data, dict) or not data.get(k):
      raise CredentialsError(f"{path} has no '{k}'; expected "
                             '{"username": "...", "key": "..."} from kaggle.com/settings')


def _notebook_secrets() -> bool:
  """In a Kaggle notebook, secrets named KAGGLE_USERNAME and KAGGLE_KEY, if the user added them."""
  if not in_kaggle_notebook():
    return False
  try:
    from kaggle_secrets import UserSecretsClient  # only inside Kaggle notebooks

    client = UserSecretsClient()
    user, key = client.get_secret("KAGGLE_USERNAME"), client.get_secret("KAGGLE_KEY")
  except Exception:  # no such secret, or not attached to the notebook
    return False
  if user and key:
    import kagglehub.config

    kagglehub.config.set_kaggle_credentials(user, key)
  return bool(user and key)


def in_kaggle_notebook() -> bool:
  return "KAGGLE_KERNEL_RUN_TYPE" in os.environ  # set by Kaggle in every notebook session


def api_host() -> tuple[str, int]:
  """The host and port a kagglehub download connects to first: the proxy the environment names
  for it (`proxy_for`), else the API host (KAGGLE_API_ENVIRONMENT selects it)."""
  try:
    from kagglesdk.kaggle_env import get_endpoint, get_env

    url = get_endpoint(get_env())
  except Exception:  # an unknown KAGGLE_API_ENVIRONMENT: kagglehub will complain itself
    url = "https://api.kaggle.com"
  return first_hop(url)


_PORTS = {"http": 80, "https": 443, "socks4": 1080, "socks5": 1080, "socks5h": 1080}


def first_hop(url: str) -> tuple[str, int]:
  """The host and port a request to `url` connects to first: its proxy (`proxy_for`), else the
  url's own host and port."""
  return proxy_for(url) or _address(urlsplit(url))


def proxy_for(url: str) -> tuple[str, int] | None:
  """The host and port of the proxy a request to `url` goes through, as httpx and requests
  choose it: the one the environment names for the url's scheme (HTTPS_PROXY or https_proxy;
  else ALL_PROXY), unless NO_PROXY names the url's host; None: none."""
  from urllib.request import getproxies, proxy_bypass

  u = urlsplit(url)
  proxies = getproxies()
  proxy = proxies.get(u.scheme) or proxies.get("all")
  if not proxy or proxy_bypass(u.hostname or ""):
    return None
  return _address(urlsplit(proxy if "://" in proxy else f"http://{proxy}"))  # as httpx reads it


def _address(u) -> tuple[str, int]:
  try:
    port = u.port
  except ValueError:  # not a number: the connection will fail as the request's would
    port = None
  return u.hostname or "", port or _PORTS.get(u.scheme, 80)


def reachable(host: str, port: int, timeout: float = 3.0) -> bool:
  try:
    socket.create_connection((host, port), timeout=timeout).close()
  except OSError:
    return False
  return True


def newest_cached(h, path: str | None = None) -> tuple[int, pathlib.Path] | None:
  """(version, local path) of the newest complete copy of kagglehub handle `h` (a model's or a
  dataset's, parsed; `path`: a file inside it) in kagglehub's cache, or None: the file
  downloaded alone, or inside a complete download of the whole version. Either is read where it
  lies, with no credentials and no network."""
  from kagglehub.cache import Cache

  cache = Cache()
  base = pathlib.Path(cache.get_path(h.with_version(1))).parent
  versions = [h.version] if h.is_versioned() else sorted(
      (int(p.name) for p in base.glob("*") if p.name.isdigit()), reverse=True)
  for v in versions:
    one = h.with_version(v)
    hit = cache.load_from_cache(one, path) or (path and _inside_whole(cache, one, path))
    if hit:
      return v, pathlib.Path(hit)
  return None


def _inside_whole(cache, h, path: str) -> str | None:
  """File `path` inside a complete download of the whole of versioned `h`: kagglehub marks that
  with OWNER/NAME/N.complete, and gives the file no .complete/N/PATH.complete of its own."""
  whole = cache.load_from_cache(h)
  inside = pathlib.Path(whole or "", path.lstrip("/"))
  return str(inside) if whole and inside.is_file() else None


def scrub(text: str) -> str:
  """`text` with every credential kagglehub may hold (from any source) replaced by ***."""
  import kagglehub.config

  try:
    c = kagglehub.config.get_kaggle_credentials()
  except Exception:  # a malformed kaggle.json: nothing of it was used
    c = None
  for secret in (os.environ.get("KAGGLE_KEY"), os.environ.get("KAGGLE_API_TOKEN"),
                 getattr(c, "key", None), getattr(c, "api_key", None)):
    if secret:
      text = text.replace(secret, "***")
  return text
