"""LangChain's ChatOpenAI against unmask (pip install langchain-openai): base_url, and the diffusion fields
through extra_body."""
from langchain_openai import ChatOpenAI
from openai import OpenAI

from _common import API_KEY, BASE_URL

model = OpenAI(base_url=BASE_URL, api_key=API_KEY).models.list().data[0].id
llm = ChatOpenAI(model=model, base_url=BASE_URL, api_key=API_KEY, max_tokens=16, temperature=0,
                 extra_body={"block_size": 2, "steps": 8})
reply = llm.invoke("Name three colours.")
print(reply.content)
print("usage:", reply.usage_metadata["output_tokens"], "tokens")
for piece in llm.stream("Count to five."):
    print(piece.content, end="", flush=True)
print()
