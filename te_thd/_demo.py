"""The README's main job. Until the EP+CP training example lands, it runs the
THD conversion of the reference page's worked example and prints the result."""

from __future__ import annotations

import argparse


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="runs/demo", help="working directory for the demo")


def run_demo(args: argparse.Namespace) -> int:
    import torch

    from te_thd.thd_utils import process_input_for_thd

    batch = {
        "input_ids": torch.tensor([[1, 2, 3, 99, 4, 5], [6, 7, 8, 9, 10, 11]]),
        "labels": torch.tensor([[2, 3, 99, 4, 5, 6], [7, 8, 9, 10, 11, 12]]),
        "position_ids": torch.tensor([[0, 1, 2, 0, 0, 1], [0, 1, 2, 3, 4, 5]]),
        "seq_lens": torch.tensor([[3, 2], [6, -1000]]),
        "seq_lens_padded": torch.tensor([[4, 2], [6, -1000]]),
    }
    out = process_input_for_thd(batch)
    for k, v in out.items():
        print(f"{k}: {v}")
    return 0
