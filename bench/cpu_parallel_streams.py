"""Four greedy chat streams in a row, then at once, against a running `strata serve` (issue 51
item 22): time to first token, end, and the order the chunks arrived in.

Usage: python bench/cpu_parallel_streams.py http://127.0.0.1:PORT
"""

from __future__ import annotations

import asyncio
import sys
import time

import openai

MODEL = "SmolLM2-135M-Instruct.Q4_1"
QUESTIONS = ("What is the capital of France?", "Name three primary colours.",
             "How many legs does a spider have?", "Who wrote Hamlet?")


async def one_stream(client: openai.AsyncOpenAI, question: str, started_s: float,
                     order: list[tuple[float, int]], index: int) -> tuple[float, float, int]:
    """(first chunk s, end s, chunks) of one greedy stream of 32 tokens."""
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=32,
        temperature=0, stream=True)
    first_s, num_chunks = None, 0
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            now_s = time.monotonic() - started_s
            first_s = first_s if first_s is not None else now_s
            num_chunks += 1
            order.append((now_s, index))
    return first_s or 0.0, time.monotonic() - started_s, num_chunks


def _row(results: list[tuple[float, float, int]]) -> str:
    return "; ".join(f"{first:.2f},{end:.2f},{n}" for first, end, n in results)


async def main(base_url: str) -> None:
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0,
                                timeout=300)
    await one_stream(client, "hi", time.monotonic(), [], 0)  # warm up
    started_s = time.monotonic()
    in_a_row = [await one_stream(client, q, time.monotonic(), [], i)
                for i, q in enumerate(QUESTIONS)]
    in_a_row_s = time.monotonic() - started_s
    order: list[tuple[float, int]] = []
    started_s = time.monotonic()
    at_once = await asyncio.gather(*(one_stream(client, q, started_s, order, i)
                                     for i, q in enumerate(QUESTIONS)))
    at_once_s = time.monotonic() - started_s
    await client.close()
    print(f"in a row: {in_a_row_s:.2f} s; (first s, end s, chunks): {_row(in_a_row)}")
    print(f"at once:  {at_once_s:.2f} s; (first s, end s, chunks): {_row(list(at_once))}")
    print("chunk order:", "".join(str(index) for _, index in sorted(order)))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
