"""Call `dflash-trt serve` with the official `openai` Python client.

    dflash-trt serve --target $(dflash-trt fetch-models --quiet) --drafter examples/drafters/smollm2-dflash-b16 \
        --model-name smollm2 --port 8000 &
    python examples/openai_client.py --base-url http://127.0.0.1:8000/v1 --model smollm2

Streams a chat completion (with a final usage chunk), then makes a non-streaming completion
and prints the DFlash statistics the server adds to each response (`dflash`: τ = tokens per
target verify step, acceptance histogram).
"""

from __future__ import annotations

import argparse
import sys

from openai import OpenAI


def main() -> int:
    p = argparse.ArgumentParser(description="call dflash-trt serve with the openai client")
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--model", help="model id (default: the first one /v1/models lists)")
    p.add_argument("--prompt", default="Write a Python function that reverses a string.")
    p.add_argument("--max-tokens", type=int, default=128)
    args = p.parse_args()

    client = OpenAI(base_url=args.base_url, api_key="not-needed")  # the server checks no key
    model = args.model or client.models.list().data[0].id

    # 1. Streamed chat: text arrives as the server commits tokens; the last chunk carries usage.
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": args.prompt}], max_tokens=args.max_tokens,
        temperature=0, stream=True, stream_options={"include_usage": True},
    )
    usage = stats = None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            sys.stdout.write(chunk.choices[0].delta.content)
            sys.stdout.flush()
        if chunk.usage is not None:
            usage, stats = chunk.usage, (chunk.model_extra or {}).get("dflash")
    print(f"\n[chat] {usage.completion_tokens} tokens; dflash {stats}")

    # 2. Plain completion, sampled (temperature / top_p / seed are per request), with a stop string.
    done = client.completions.create(
        model=model, prompt="def fibonacci(n):", max_tokens=64, temperature=0.7, top_p=0.9, seed=0, stop=["\n\n"],
    )
    print(done.choices[0].text)
    print(f"[completion] finish_reason={done.choices[0].finish_reason} usage={done.usage} dflash={done.model_extra.get('dflash')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
