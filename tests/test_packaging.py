"""What the package says about itself is true: one version, a licence file, typed."""

import importlib.metadata
import pathlib

import statefulremat as sr

ROOT = pathlib.Path(__file__).parent.parent


def test_one_version_in_the_metadata_and_the_module():
  assert importlib.metadata.version("statefulremat") == sr.__version__


def test_the_licence_and_the_typed_marker_ship_with_the_package():
  meta = importlib.metadata.metadata("statefulremat")
  assert meta["License-Expression"] == "Apache-2.0"
  assert "Apache License" in (ROOT / "LICENSE").read_text()
  assert (pathlib.Path(sr.__file__).parent / "py.typed").exists()
  assert meta["Requires-Python"] == ">=3.11"
