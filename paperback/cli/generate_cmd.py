"""`paperback generate [MODEL] PROMPT`: stream a completion."""

from __future__ import annotations

import argparse
import sys

from paperback.cli.common import add_dtype_arg, add_json_arg, add_kernel_args, add_kv_cache_dtype_arg, kv_cache_dtype
from paperback.cli.output import note, print_json
from paperback.errors import PaperbackError
from paperback.loading.sources import DEFAULT_MODEL


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt, streaming tokens as they come",
                       description="Generate a completion. With one positional argument it is the prompt "
                                   f"and the model is {DEFAULT_MODEL}; with two, MODEL then PROMPT.")
    p.add_argument("args", nargs="+", metavar="[MODEL] PROMPT")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--raw", action="store_true",
                   help="send the prompt as plain text even if the model has a chat template")
    p.add_argument("--ignore-eos", action="store_true")
    add_dtype_arg(p)
    add_kv_cache_dtype_arg(p)
    add_kernel_args(p)
    add_json_arg(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from paperback.generation import SamplingParams, generate
    from paperback.loading import load_model

    if len(args.args) > 2:
        raise PaperbackError("give at most MODEL and PROMPT (quote the prompt)")
    model_spec, prompt = (args.args if len(args.args) == 2 else (DEFAULT_MODEL, args.args[0]))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos)
    lm = load_model(model_spec, args.dtype)
    chat = lm.tokenizer.chat_template is not None and not args.raw

    def stream(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    result = generate(lm, prompt, params, chat=chat, on_text=None if args.json else stream,
                      cache_dtype=kv_cache_dtype(args, "generate"))
    if args.json:
        print_json({"model": lm.source.label, "chat": chat, "text": result.text,
                    "token_ids": result.token_ids, "finish_reason": result.finish_reason,
                    "prompt_tokens": result.prompt_tokens,
                    "time_to_first_token_s": result.time_to_first_token_s,
                    "decode_tokens_per_s": result.decode_tokens_per_s})
    else:
        sys.stdout.write("\n")
        note(f"[{len(result.token_ids)} tokens, finish: {result.finish_reason}, "
             f"first token {result.time_to_first_token_s:.2f}s, {result.decode_tokens_per_s:.1f} tokens/s]")
    return 0
