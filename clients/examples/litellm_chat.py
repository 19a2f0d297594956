"""LiteLLM against unmask (pip install litellm): the `openai/` provider prefix with api_base; the diffusion fields
through extra_body."""
import litellm
from openai import OpenAI

from _common import API_KEY, BASE_URL

model = OpenAI(base_url=BASE_URL, api_key=API_KEY).models.list().data[0].id
reply = litellm.completion(model=f"openai/{model}", api_base=BASE_URL, api_key=API_KEY, max_tokens=16,
                           messages=[{"role": "user", "content": "Name three colours."}],
                           extra_body={"block_size": 2, "steps": 8})
print(reply.choices[0].message.content)
print("usage:", reply.usage.completion_tokens, "tokens")
