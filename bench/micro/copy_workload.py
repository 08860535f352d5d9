"""A copy-heavy chat workload: edit, rewrite and quote requests whose answers repeat much of their
prompt — what n-gram speculation (prompt lookup) is for. The passages are this file's own prose.

    prompts = copy_prompts(tokenizer, 16, seed=0)   # chat-templated token ids, one per request

Each request pairs an instruction with a passage (both drawn with the seed) and is rendered with
the tokenizer's chat template (a plain "User: ... Assistant:" framing without one).
"""

from __future__ import annotations

import random

PASSAGES = (
    "The river town woke early. Fishermen pulled their boats onto the gravel, the baker opened his "
    "shutters, and the ferry sounded its horn twice before leaving for the far bank. By eight the "
    "market square was full of carts, and the smell of bread drifted over the water.",
    "To replace a bicycle tire, first release the brake and remove the wheel. Let out any remaining "
    "air, then use two tire levers to lift one side of the tire over the rim. Pull out the old tube, "
    "check the inside of the tire for thorns, and fit the new tube before seating the tire again.",
    "Our quarterly results show revenue of 4.2 million, up 12 percent from the previous quarter. "
    "Costs rose by 3 percent, mostly from shipping. The team plans to open two new stores in the "
    "spring and to hire six more engineers for the online shop.",
    "The meeting is moved from Tuesday to Thursday at 10:30 in room 4B. Please bring the signed "
    "forms, your laptop and the draft of the budget. If you cannot attend, send your comments to "
    "the project lead by Wednesday evening.",
    "Photosynthesis turns light into chemical energy. In the leaves, chlorophyll absorbs sunlight, "
    "and the plant uses that energy to join carbon dioxide and water into sugar, releasing oxygen. "
    "The sugar feeds the plant and, through it, almost every animal on land.",
    "def average(values):\n    total = 0\n    for value in values:\n        total += value\n"
    "    return total / len(values)\n\nprint(average([3, 5, 7, 9]))",
    "Dear Ms. Rivera, thank you for your order of three blue lamps. Two lamps were shipped today and "
    "the third will follow next week, as it is out of stock. We are sorry for the delay and have "
    "refunded the shipping cost of the second parcel.",
    "The library opens at nine on weekdays and at ten on Saturdays. Books may be borrowed for three "
    "weeks and renewed twice online. Laptops are lent for one day at a time, and the reading room "
    "on the second floor is kept quiet at all hours.",
)

INSTRUCTIONS = (
    "Repeat the following text exactly, then add one sentence saying what it is about.",
    "Rewrite the following text in the past tense, keeping everything else the same.",
    "Correct any mistakes in the following text and return the whole corrected text.",
    "Quote the following text in full, then list its three most important facts.",
)


def copy_messages(num_prompts: int, seed: int) -> list[list[dict]]:
    """One single-turn conversation per request: an instruction and a passage."""
    rng = random.Random(f"copy:{seed}")
    return [
        [{"role": "user", "content": f"{rng.choice(INSTRUCTIONS)}\n\n{rng.choice(PASSAGES)}"}]
        for _ in range(num_prompts)
    ]


def copy_prompts(tokenizer, num_prompts: int, seed: int) -> list[list[int]]:
    """The requests as token ids, through the tokenizer's chat template when it has one."""
    prompts = []
    for messages in copy_messages(num_prompts, seed):
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            prompts.append(list(ids if isinstance(ids, list) else ids["input_ids"]))  # (a BatchEncoding in 5.x)
        else:
            prompts.append(tokenizer(f"User: {messages[0]['content']}\nAssistant:")["input_ids"])
    return prompts
