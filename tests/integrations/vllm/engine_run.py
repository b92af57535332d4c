"""Runs one vLLM engine over phases of token-id prompts and writes the outputs as JSON.

``python -m tests.integrations.vllm.engine_run SPEC.json OUT.json``; SPEC: ``model`` (a
directory), ``connector`` (``null`` or a ``kv_transfer_config`` dict), ``block_size``, ``dtype``,
``phases``: a list of ``{"name", "prompts": [[ids]], "faults": mode or null}`` (a prompt may
be a ``TokensPrompt`` dict instead, e.g. with a ``cache_salt``),
``max_tokens``. OUT: per phase, per prompt, the token ids, their logprobs and
``num_cached_tokens``; rewritten after every phase, so the phases before a crash keep their
results. A process of its own: vLLM's engine spawns workers and must start under
``__main__``.
"""

from __future__ import annotations

import json
import os
import sys


def run(spec: dict, out_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = {}
    if spec.get("connector"):
        kwargs["kv_transfer_config"] = spec["connector"]
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, dtype=spec["dtype"],
              block_size=spec["block_size"], enforce_eager=True, gpu_memory_utilization=0.1,
              kv_cache_memory_bytes=32 << 20, max_model_len=1024, seed=0, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], logprobs=0,
                            detokenize=False)
    out = {}
    for phase in spec["phases"]:
        if phase.get("faults") is not None:
            with open(os.environ["KVMOVE_TEST_FAULTS"], "w") as f:
                json.dump({"mode": phase["faults"]}, f)
        results = llm.generate([TokensPrompt(**p) if isinstance(p, dict)
                                else TokensPrompt(prompt_token_ids=p) for p in phase["prompts"]],
                               params, use_tqdm=False)
        out[phase["name"]] = [
            {
                "token_ids": list(r.outputs[0].token_ids),
                "logprobs": [lp[t].logprob for lp, t in zip(r.outputs[0].logprobs,
                                                            r.outputs[0].token_ids,
                                                            strict=True)],
                "num_cached_tokens": r.num_cached_tokens,
                "finish_reason": r.outputs[0].finish_reason,
            }
            for r in results
        ]
        with open(out_path + ".tmp", "w") as f:
            json.dump(out, f)
        os.replace(out_path + ".tmp", out_path)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        run(json.load(f), sys.argv[2])
