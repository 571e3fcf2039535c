"""`python -m bench [name ...]`: runs bench/<name>.py's `main()` for each name (all by default)."""

from __future__ import annotations

import importlib
import pathlib
import sys

HERE = pathlib.Path(__file__).parent


def available() -> list[str]:
  return sorted(p.stem for p in HERE.glob("*.py") if p.stem not in ("__init__", "__main__",
                                                                       "common"))


def main(argv: list[str]) -> int:
  names = [a for a in argv if a] or available()
  unknown = [n for n in names if n not in available()]
  if unknown:
    print(f"error: unknown benchmark {', '.join(unknown)}; expected one of "
          f"{', '.join(available())}", file=sys.stderr)
    return 2
  for name in names:
    print(f"== bench {name} ==", flush=True)
    importlib.import_module(f"bench.{name}").main()
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
