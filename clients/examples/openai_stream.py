"""Streamed text with the openai SDK: the deltas are the final, left-to-right text."""
from openai import OpenAI

from _common import API_KEY, BASE_URL

client = OpenAI(base_url=BASE_URL, api_key=API_KEY)
model = client.models.list().data[0].id
stream = client.chat.completions.create(model=model, max_tokens=16, stream=True,
                                        messages=[{"role": "user", "content": "Name three colours."}])
for chunk in stream:
    if chunk.choices:
        print(chunk.choices[0].delta.content or "", end="", flush=True)
print()
