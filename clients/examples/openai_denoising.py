"""Every denoising step with the openai SDK: `stream_options.include_denoising` adds one chunk per step whose
top-level `denoising` object (an extra field: `chunk.model_extra["denoising"]`) holds the canvas."""
from openai import OpenAI

from _common import API_KEY, BASE_URL

client = OpenAI(base_url=BASE_URL, api_key=API_KEY)
model = client.models.list().data[0].id
stream = client.chat.completions.create(
    model=model, max_tokens=12, stream=True, messages=[{"role": "user", "content": "Hi"}],
    stream_options={"include_denoising": True, "include_usage": True},
    extra_body={"threshold": 0.9})   # parallel decoding: every position at least 90% sure, with the next one
for chunk in stream:
    d = (chunk.model_extra or {}).get("denoising")
    if d:
        canvas = "".join("_" if t is None else t for t in d["canvas"])
        revealed = [r["position"] for r in d["revealed"]]
        print(f"step {d['step']:2d} block {d['block']} nfe {d['nfe']:2d} revealed {revealed}: {canvas!r}")
    elif chunk.usage:
        print("usage:", chunk.usage.completion_tokens, "tokens,", chunk.usage.model_extra.get("nfe"), "forwards")
