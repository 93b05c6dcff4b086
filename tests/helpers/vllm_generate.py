"""Greedy generation with vLLM's offline LLM in its own process; prints JSON to stdout.

usage: python vllm_generate.py MODEL_DIR PROMPTS_JSON MAX_TOKENS
PROMPTS_JSON: a list of token-id lists.
"""

import json
import sys


def main() -> None:
    from vllm import LLM, SamplingParams

    model, prompts_json, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
    prompts = json.loads(prompts_json)
    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=512,
              gpu_memory_utilization=0.15, max_num_seqs=8, skip_tokenizer_init=True, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1, ignore_eos=True,
                            detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    result = [list(o.outputs[0].token_ids) for o in outs]
    print("SMOE_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
