"""CPU tests of the graph-launch probe's pieces (measure/graph_launch.py, engine.graphs.capture_segments): the
backbone's `after_layer` hook, which the segmented capture cuts at, is called once after every layer in order and
changes no bit; the probe's arguments are checked before any 27B build. The capture itself needs a GPU:
tests/test_gpu_graphs.py::test_a_forward_cut_into_graphs_gives_the_one_graphs_bits and the probe's own bitwise check.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from engine.stages import build_engine
from engine.weights import MergedWeights
from measure import graph_launch
from reference.shapes import TINY
from reference.weights import synthetic_weights


def test_after_layer_is_called_once_after_every_layer_and_changes_no_bit():
    engine = build_engine(MergedWeights.from_decision_weights(synthetic_weights(TINY, seed=5)), "merged")
    candidates, groups = [[101, 7, 9, 11, 5], [101, 7, 9, 12], [101, 8]], [0, 0, 0]
    want = engine.forward(engine.prepare(candidates, groups))
    calls = []
    engine.after_layer = calls.append
    got = engine.forward(engine.prepare(candidates, groups))
    assert calls == list(range(TINY.num_layers)) and torch.equal(got, want)


def test_cuts_are_distinct_ascending_layers_before_the_last():
    assert graph_launch.parse_cuts("3,15") == (3, 15) and graph_launch.parse_cuts("0") == (0,)
    for bad in ("15,3", "3,3", "-1", "63", "a", "3,"):
        with pytest.raises(argparse.ArgumentTypeError):
            graph_launch.parse_cuts(bad)


def test_the_probe_refuses_bad_arguments_before_building(capsys):
    for argv, message in ((["--stage", "core", "--rounds", "4"], "--rounds must be >= 5"),
                          (["--stage", "tree"], "stage tree captures no CUDA graphs"),
                          (["--cuts", "70"], "distinct ascending layers")):  # fmt: skip
        with pytest.raises(SystemExit) as exit_:
            graph_launch.main(argv)
        assert exit_.value.code == 2 and message in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown workload"):
        graph_launch.main(["--workloads", "no-such-workload"])
