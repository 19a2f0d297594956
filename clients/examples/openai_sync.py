"""A plain chat completion with the openai SDK, with diffusion knobs in extra_body."""
from openai import OpenAI

from _common import API_KEY, BASE_URL

client = OpenAI(base_url=BASE_URL, api_key=API_KEY)
model = client.models.list().data[0].id
reply = client.chat.completions.create(
    model=model, max_tokens=16, temperature=0,
    messages=[{"role": "user", "content": "Name three colours."}],
    extra_body={"block_size": 2, "steps": 8},          # unmask's diffusion fields: extra top-level fields
)
print(reply.choices[0].message.content)
print("usage:", reply.usage.completion_tokens, "tokens,", reply.usage.model_extra.get("nfe"), "forwards")
