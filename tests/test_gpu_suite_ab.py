"""The A/B stage of benchmarks/gpu_suite.py: its tree specs, and the import check that
stops a run whose tree would load another directory's code (session 19's A/Bs ran from the
repository root and measured main in every tree)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from benchmarks import gpu_suite


def test_tree_spec_parses_name_directory_and_settings(tmp_path):
    name, directory, env = gpu_suite.parse_ab_tree(
        f"local={tmp_path},NANOSERVE_PUSH_PARTIALS=local,EXP_X=")
    assert (name, directory) == ("local", tmp_path.resolve())
    assert env == {"NANOSERVE_PUSH_PARTIALS": "local", "EXP_X": ""}


@pytest.mark.parametrize("spec", ["main", "=/tmp/x", "main=", "x=/tmp/x,NOVALUE"])
def test_bad_tree_spec_names_the_entry(spec):
    with pytest.raises(ValueError, match="--ab-trees"):
        gpu_suite.parse_ab_tree(spec)


def _args(*trees: str) -> argparse.Namespace:
    # No TP sizes: only the import checks run (the benches need GPUs).
    return argparse.Namespace(ab_trees=list(trees), ab_tp=[], ab_rounds=1)


def test_a_tree_that_imports_the_repository_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_suite, "OUT", tmp_path / "out")
    # The repository on PYTHONPATH, as on the device: with no models/ in the tree, the
    # import falls through to it.
    monkeypatch.setenv("PYTHONPATH", str(gpu_suite.ROOT))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(RuntimeError, match="tree empty imports"):
        gpu_suite.stage_ab(_args(f"main={gpu_suite.ROOT}", f"empty={empty}"))


def test_the_repository_tree_passes_the_import_check(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_suite, "OUT", tmp_path / "out")
    gpu_suite.stage_ab(_args(f"main={gpu_suite.ROOT}"))
    log = (tmp_path / "out" / "ab_main_import.log").read_text()
    assert Path(log.strip().splitlines()[-1]).resolve().is_relative_to(gpu_suite.ROOT)
