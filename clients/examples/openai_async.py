"""Several questions at once with the async openai SDK (the server batches them)."""
import asyncio

from openai import AsyncOpenAI

from _common import API_KEY, BASE_URL


async def main():
    client = AsyncOpenAI(base_url=BASE_URL, api_key=API_KEY)
    model = (await client.models.list()).data[0].id
    questions = ["Name three colours.", "Count to five.", "Say hello."]
    replies = await asyncio.gather(*(
        client.chat.completions.create(model=model, max_tokens=12, messages=[{"role": "user", "content": q}])
        for q in questions))
    for q, r in zip(questions, replies):
        print(f"{q} -> {r.choices[0].message.content!r}")
    await client.close()


asyncio.run(main())
