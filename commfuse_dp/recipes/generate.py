"""Generate text from a fine-tuned causal LM (a folder written by a recipe, or any local HF causal-LM folder).

    python -m commfuse_dp.recipes.generate runs/clm/model --prompt "The assert statement"
    python commfuse_dp/recipes/generate.py runs/clm/model --prompt "for loops" --max_new_tokens 60 --temperature 0.8
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a local Hugging Face causal-LM folder with its tokenizer")
    parser.add_argument("--prompt", default="The assert statement", help="the text to continue (default: %(default)r)")
    parser.add_argument("--max_new_tokens", type=int, default=40, help="tokens to generate (default %(default)s)")
    parser.add_argument("--temperature", type=float, default=0.8,
                        help="sampling temperature; 0: greedy decoding (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="the sampling seed (default %(default)s)")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        parser.error(f"--max_new_tokens {args.max_new_tokens}: must be at least 1")
    if args.temperature < 0:
        parser.error(f"--temperature {args.temperature}: must be 0 (greedy) or more")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True).eval()
    except (OSError, ValueError) as exc:
        if not os.path.exists(args.model):  # (a name in the Hugging Face cache would have loaded)
            parser.error(f"{args.model}: no such folder, and no model of that name in the Hugging Face cache "
                         f"(nothing is downloaded)")
        print(f"error: {args.model} is not a Hugging Face causal-LM folder with a tokenizer "
              f"({str(exc).strip().splitlines()[0]})", file=sys.stderr)
        return 2
    torch.manual_seed(args.seed)
    inputs = tokenizer(args.prompt, return_tensors="pt")
    sample = args.temperature > 0
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=sample,
                             temperature=args.temperature if sample else None, top_k=None, top_p=None,
                             pad_token_id=tokenizer.pad_token_id)
    print(tokenizer.decode(out[0], skip_special_tokens=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
