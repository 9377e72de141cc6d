"""One engine unit launched by torchrun: every rank runs this script.

    torchrun --nproc-per-node 2 examples/engine_torchrun.py [--model PATH]

Each rank joins the job's process group, builds its part of the unit (its requests' KV cache, the
experts of its EP slots), runs every world-th prompt and gets all results back.
"""

from __future__ import annotations

import argparse

import torch.distributed as dist

from moeinfra.engine import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="checkpoint folder (default: built-in tiny)")
    parser.add_argument("--backend", default="gloo", help="gloo (CPU) or nccl (GPU)")
    args = parser.parse_args()
    dist.init_process_group(args.backend)
    llm = LLM(args.model, ranks=None, redundant_experts=2, eplb_interval=4)
    prompts = ["Expert parallelism is", "MLA caches", "The decode unit", "Prefill units"]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    if dist.get_rank() == 0:
        for out in outputs:
            print(f"{out.prompt!r} -> {out.outputs[0].text!r}")
    llm.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
