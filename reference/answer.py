"""Answer one Open-Jev request file with the reference model and print the response JSON.

    python -m reference.answer [REQUEST.json | WORKLOAD_ID] [--backend hf_torch|hf_fla] [--shapes qwen3.8-27b|tiny]

With no argument it answers the `drone` request of the shared Open-Jev latency workloads. On a CUDA machine it builds
the 27B shapes on the GPU, otherwise the tiny twin on the CPU, and says which on stderr. The weights are synthetic
(seeded random): the probabilities exercise the true numerics path but carry no meaning for accuracy.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from reference.data import open_jev_workloads
from reference.model import HFBackbone
from reference.service import DecisionModel
from reference.shapes import QWEN38_27B, TINY, get_shapes
from reference.weights import synthetic_weights


def load_request(source: str) -> dict:
    path = Path(source)
    if path.is_file():
        return json.loads(path.read_text())
    workloads = open_jev_workloads()
    if source not in workloads:
        raise SystemExit(f"{source!r} is neither a file nor a workload id ({', '.join(sorted(workloads))})")
    return workloads[source]["request"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("request", nargs="?", default="drone", help="request JSON file or workload id (default: drone)")
    parser.add_argument(
        "--backend",
        choices=["hf_torch", "hf_fla"],
        default=None,
        help="default: hf_fla on CUDA, hf_torch on the CPU (FLA's bf16 kernels need a GPU)",
    )
    parser.add_argument(
        "--shapes",
        choices=[QWEN38_27B.name, TINY.name],
        default=None,
        help="default: the 27B on CUDA, the tiny twin on the CPU",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic weights")
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available()
    shapes = get_shapes(args.shapes or (QWEN38_27B.name if cuda else TINY.name))
    backend = args.backend or ("hf_fla" if cuda else "hf_torch")
    device = torch.device("cuda" if cuda else "cpu")
    print(
        f"[answer] {shapes.name} shapes on {torch.cuda.get_device_name() if cuda else 'the CPU'}, backend {backend}; "
        "synthetic weights: probabilities are meaningless for accuracy",
        file=sys.stderr,
    )
    weights = synthetic_weights(shapes, seed=args.seed, device=device)
    model = DecisionModel(HFBackbone(weights, backend.removeprefix("hf_")), weights)
    response = model.decide(load_request(args.request))
    print(json.dumps(response, indent=2, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
