"""tools/soak.py's full-disk fault: a disk the run has filled already is the fault itself, not
the soak's own error (its ballast's creation refused, ENOSPC); any other error still stops it."""

import builtins
import errno
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import soak  # noqa: E402


def _refusing(code):
  real = builtins.open

  def refuse(path, *args, **kwargs):
    if str(path).endswith("ballast"):
      raise OSError(code, "refused")
    return real(path, *args, **kwargs)
  return refuse


def test_a_disk_already_full_leaves_no_ballast(tmp_path, monkeypatch):
  monkeypatch.setattr(builtins, "open", _refusing(errno.ENOSPC))
  ballast = soak.fill(tmp_path)
  assert ballast == tmp_path / "ballast" and not ballast.exists()


def test_another_error_still_stops_the_soak(tmp_path, monkeypatch):
  monkeypatch.setattr(builtins, "open", _refusing(errno.EACCES))
  with pytest.raises(PermissionError):
    soak.fill(tmp_path)
