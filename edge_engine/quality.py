"""Do a mode's answers hold against float32?  A fixed set of 50 prompts (greedy outputs
compared token by token) and a held-out text (perplexity), shared by the engine's tests and
``bench/engine.py``.

The held-out text was written for this file (it is in no training set); the prompts mix
facts, arithmetic, code, instructions and multilingual questions, like an edge gateway's
small-model traffic.
"""

from __future__ import annotations

import asyncio
import math
import statistics
from dataclasses import dataclass

import torch

from edge_engine import Engine, SamplingParams
from edge_engine.sequence import Sequence

PROMPTS = [
    "What is the capital of France?",
    "What is 12 * 7?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "Explain what a CPU cache is in two sentences.",
    "Translate 'good morning' into Spanish.",
    "What is the boiling point of water in Celsius?",
    "Give me a synonym for 'happy'.",
    "Write a Python function that returns the square of a number.",
    "Who wrote Romeo and Juliet?",
    "How many days are in a leap year?",
    "What does HTTP stand for?",
    "Summarise the plot of Cinderella in one sentence.",
    "List four planets of the solar system.",
    "What is photosynthesis?",
    "Suggest a name for a friendly robot.",
    "What is the opposite of 'cold'?",
    "How do I reverse a list in Python?",
    "Why do leaves change color in autumn?",
    "What is the largest ocean on Earth?",
    "Write a short apology for being late to a meeting.",
    "What is 100 divided by 4?",
    "Explain recursion to a child.",
    "What language is spoken in Brazil?",
    "Give one tip for sleeping better.",
    "What is the chemical symbol for gold?",
    "Write a SQL query that counts the rows of a table named users.",
    "What are the three states of matter?",
    "Describe a cat in five words.",
    "What is the speed of light, roughly?",
    "Who painted the Mona Lisa?",
    "What is a prime number?",
    "Write a limerick about a programmer.",
    "How many continents are there?",
    "What is the difference between weather and climate?",
    "Quelle est la capitale de l'Italie ?",
    "¿Cuántas patas tiene una araña?",
    "Was ist die Hauptstadt von Deutschland?",
    "What is the freezing point of water in Fahrenheit?",
    "Give an example of a mammal that can fly.",
    "What does a compiler do?",
    "Write a one-line motivational quote.",
    "What is the square root of 81?",
    "Explain what an API is.",
    "Which is heavier, a kilogram of feathers or a kilogram of iron?",
    "What year did the first person walk on the Moon?",
    "Recommend a healthy breakfast.",
    "What is the main ingredient of guacamole?",
    "How does a rainbow form?",
    "Write a JavaScript statement that prints hello to the console.",
]
assert len(PROMPTS) == 50

HELDOUT_TEXT = """\
The harbour town woke slowly on winter mornings. Before the first ferry left, the baker on
the corner had already sold most of his rye loaves to the fishermen, who ate them standing
at the counter while they argued about the weather. Nobody trusted the forecast on the
radio; they trusted the colour of the water and the way the gulls sat on the breakwater.

When the library reopened after the repairs, the librarian decided to move the maps to the
ground floor. Visitors had always asked for them, and carrying the heavy atlases down the
narrow staircase had become a small daily ordeal. She spent a week sorting them by region,
then by date, and finally by how often they were borrowed, which turned out to be the only
order that anyone noticed.

A good recipe for vegetable soup does not need much. Cut two onions, three carrots and a
small piece of celery, and let them soften in a little oil over a low heat. Add a handful of
lentils, a bay leaf and enough water to cover everything twice over. After forty minutes,
season it with salt, pepper and a spoonful of vinegar, which brightens the taste more than
any spice.

Engineers who build bridges think about loads that may never arrive. A footbridge must carry
a crowd leaving a stadium, the wind of a storm that comes once in a century, and the slow
fatigue of a million ordinary days. Most of that work is invisible when the bridge is done:
people see a thin line across the river and assume that it was easy.

The train to the mountains climbs for two hours through forests of pine and birch. Halfway
up, the line crosses a stone viaduct, and passengers who know the route move to the left
side of the carriage to look down at the valley. In summer the station at the top sells
cold lemonade; in winter it sells nothing, because the kiosk is buried under snow.

Learning a second language as an adult is mostly a matter of patience. The first months
feel like progress, because every new word is useful. Then comes a long plateau, when
conversations still move too fast and jokes still need explaining. Those who keep reading,
listening and speaking through that plateau usually find, one day, that they have started
to dream in the new language.

The old clock in the town hall lost three minutes every week. For years the caretaker
corrected it on Sunday evenings, climbing a ladder with a small brass key. When he retired,
the council voted to replace the mechanism with an electric one, but the townspeople
complained so much that the old clock was kept, and a younger caretaker learned to climb
the ladder.
"""


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where two outputs differ (None: identical)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


async def greedy_outputs(engine: Engine, prompts: list[str], max_tokens: int) -> list[list[int]]:
    """Greedy token ids of each chat prompt (all submitted at once: the engine batches them)."""

    async def one(prompt: str) -> list[int]:
        ids = engine.tokenizer.encode_chat([{"role": "user", "content": prompt}])
        tokens: list[int] = []
        async for delta in engine.generate(ids, SamplingParams(temperature=0, max_tokens=max_tokens)):
            tokens.extend(delta.token_ids)
        return tokens

    return list(await asyncio.gather(*(one(p) for p in prompts)))


@dataclass(slots=True)
class Agreement:
    num_prompts: int
    num_identical: int
    divergences: list[int]  # first divergence position of each differing output

    @property
    def share_identical(self) -> float:
        return self.num_identical / self.num_prompts

    @property
    def median_divergence(self) -> float | None:
        return statistics.median(self.divergences) if self.divergences else None

    def as_dict(self) -> dict:
        return {
            "prompts": self.num_prompts,
            "identical": self.num_identical,
            "share_identical": self.share_identical,
            "first_divergence_positions": sorted(self.divergences),
            "median_first_divergence": self.median_divergence,
        }


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> Agreement:
    divergences = [d for d in (first_divergence(a, b) for a, b in zip(outputs, reference)) if d is not None]
    return Agreement(len(reference), len(reference) - len(divergences), divergences)


def perplexity(engine: Engine, token_ids: list[int], chunk: int = 16) -> float:
    """exp(mean negative log-likelihood) of ``token_ids[1:]``, run through the engine's own
    runner and paged cache ``chunk`` tokens per forward pass (16: the decode kernels' path in
    the quantised modes), at most the engine's context window of them.  Call it while the
    engine serves nothing (it borrows KV blocks)."""
    token_ids = token_ids[: engine.max_model_len]
    runner, bm = engine.runner, engine.block_manager
    seq = Sequence(token_ids, SamplingParams(temperature=0))
    nll = 0.0
    try:
        with torch.inference_mode():
            while seq.num_computed_tokens < len(token_ids) - 1:
                n = min(chunk, len(token_ids) - 1 - seq.num_computed_tokens)
                bm.allocate(seq, n)
                inputs = runner.prepare([(seq, n)])
                start = seq.num_computed_tokens
                logits = runner.model(
                    inputs.input_ids, inputs.positions, runner.kv_cache.layers, inputs.meta, torch.arange(n)
                )  # [n, V]
                targets = torch.tensor(token_ids[start + 1 : start + 1 + n])
                nll -= torch.log_softmax(logits.float(), dim=-1).gather(1, targets[:, None]).sum().item()
                seq.num_computed_tokens += n
    finally:
        bm.free(seq)
    return math.exp(nll / (len(token_ids) - 1))
