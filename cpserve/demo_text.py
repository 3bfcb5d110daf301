"""Text of the embedded ``demo`` model: a generated corpus and long-context retrieval tasks.

Everything is generated from a seeded ``random.Random`` (so the corpus is ours to redistribute),
and the training script (scripts/train_demo.py), `cpserve up`'s demo request and
bench/needle.py build their prompts with the same functions:

- :func:`story` — a short children's story from a small vocabulary (the readable text);
- :func:`chat_pair` — a question and its answer (facts, small sums, greetings, stories);
- :func:`repeat_pair` — words to repeat (teaches copying, which retrieval needs);
- :func:`passkey_task` / :func:`kv_task` — a haystack of stories with a needle at a chosen
  depth and a question about it, as one user message and the expected answer.

A task's size is given in tokens of the demo tokenizer: ``count`` maps a text to its token count
(each sentence is counted once, with its leading space, and the counts are added; the BPE
pre-tokenizer splits at spaces, so the sum is the prompt's count to within a few tokens).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

NAMES = {"Anna": "she", "Ben": "he", "Tom": "he", "Lily": "she", "Mia": "she", "Max": "he", "Sam": "he",
         "Zoe": "she", "Leo": "he", "Emma": "she", "Jack": "he", "Lucy": "she", "Noah": "he", "Ella": "she",
         "Finn": "he", "Rosa": "she", "Omar": "he", "Nina": "she", "Hugo": "he", "Ivy": "she"}
ANIMALS = ["fox", "cat", "dog", "bird", "rabbit", "bear", "duck", "frog", "mouse", "owl", "horse", "fish",
           "turtle", "lion", "goat", "sheep"]
PLACES = ["forest", "garden", "park", "river", "hill", "town", "farm", "beach", "lake", "field", "village",
          "meadow"]
THINGS = ["ball", "box", "kite", "hat", "cup", "shell", "stone", "map", "lamp", "coin", "book", "boat",
          "drum", "flower", "basket", "blanket"]
COLORS = ["red", "blue", "green", "yellow", "white", "black", "brown", "pink", "orange", "purple"]
SIZES = ["big", "small", "little", "old", "new", "shiny", "soft", "tall", "round"]
FEELINGS = ["happy", "sad", "scared", "tired", "proud", "surprised", "curious", "hungry", "calm", "excited"]
ACTIVITIES = ["played in the sun", "sang a song", "built a little house", "looked at the stars",
              "ate some apples", "ran across the field", "read a book", "danced in the rain",
              "picked some berries", "watched the clouds", "swam in the water", "told funny jokes"]
WEATHER = ["The sun was warm.", "It was a windy day.", "The sky was grey and it began to rain.",
           "Snow covered the ground.", "The morning was cool and quiet.", "The stars came out at night."]
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]

# Facts a chat question can ask; the model learns them by heart.
COLOR_OF = {"the sky": "blue", "grass": "green", "the sun": "yellow", "snow": "white", "a banana": "yellow",
            "a strawberry": "red", "the night": "black", "an orange": "orange", "a frog": "green",
            "milk": "white", "a carrot": "orange", "chocolate": "brown"}
SOUND_OF = {"cat": "meow", "dog": "woof", "duck": "quack", "cow": "moo", "sheep": "baa", "owl": "hoot",
            "lion": "roar", "horse": "neigh", "frog": "ribbit", "mouse": "squeak", "goat": "maa",
            "bird": "tweet"}
LEGS_OF = {"dog": 4, "cat": 4, "bird": 2, "duck": 2, "spider": 8, "horse": 4, "fish": 0, "ant": 6,
           "frog": 4, "owl": 2, "snake": 0, "bee": 6}
HOME_OF = {"fish": "in the water", "bird": "in a nest", "bear": "in a cave", "rabbit": "in a hole",
           "bee": "in a hive", "fox": "in the forest", "cow": "on a farm", "duck": "on the lake",
           "owl": "in a tree", "lion": "on the plain", "frog": "in the pond", "horse": "in a stable"}
OPPOSITE_OF = {"big": "small", "hot": "cold", "up": "down", "happy": "sad", "fast": "slow", "day": "night",
               "old": "new", "tall": "short", "open": "closed", "light": "dark", "wet": "dry", "loud": "quiet"}
SELF = ("I am a small demo model trained by cpserve. I read stories, answer simple questions, "
        "and find a pass key hidden in a long text.")


def _a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def story(rng: random.Random, animal: str | None = None) -> str:
    """A short story (5–9 sentences) about one character, from the word lists above."""
    name = rng.choice(list(NAMES))
    he = NAMES[name]
    his = "her" if he == "she" else "his"
    animal = animal or rng.choice(ANIMALS)
    friend = rng.choice([a for a in ANIMALS if a != animal])
    place, place2 = rng.sample(PLACES, 2)
    thing, color, size = rng.choice(THINGS), rng.choice(COLORS), rng.choice(SIZES)
    feel, feel2 = rng.sample(FEELINGS, 2)
    act, act2 = rng.sample(ACTIVITIES, 2)
    opening = rng.choice([
        f"Once upon a time, there was {_a(size)} {animal} named {name}.",
        f"{name} was {_a(size)} {animal} who lived in the {place}.",
        f"There once lived {_a(animal)} called {name} in a quiet {place}.",
    ])
    middle = [
        f"{name} lived near the {place} with {his} friend, the {friend}.",
        rng.choice(WEATHER),
        f"One day, {name} found {_a(color)} {thing} by the {place2}.",
        f"{he.capitalize()} was very {feel}.",
        f"{name} and the {friend} {act}.",
        f"The {friend} said, \"Let us go to the {place2} together.\"",
        f"They walked to the {place2} and {act2}.",
        f"{name} showed the {color} {thing} to the {friend}.",
        f"The {friend} smiled and said, \"What {_a(size)} {thing}!\"",
    ]
    rng.shuffle(middle)
    ending = rng.choice([
        f"In the end, {name} was {feel2} and went home.",
        f"That night, {name} slept well and dreamed of the {place2}.",
        f"From that day on, {name} and the {friend} were best friends.",
        f"{name} kept the {thing} forever, and {he} was {feel2}.",
    ])
    return " ".join([opening, *middle[: rng.randint(3, 7)], ending])


def chat_pair(rng: random.Random) -> tuple[str, str]:
    """One user question and the assistant's answer."""
    kind = rng.randrange(9)
    if kind == 0:
        x = rng.choice(list(COLOR_OF))
        return rng.choice([f"What color is {x}?", f"What is the color of {x}?"]), \
            f"{x[0].upper() + x[1:]} is {COLOR_OF[x]}."
    if kind == 1:
        x = rng.choice(list(SOUND_OF))
        return f"What does {_a(x)} say?", f"{_a(x).capitalize()} says {SOUND_OF[x]}."
    if kind == 2:
        x = rng.choice(list(LEGS_OF))
        n = LEGS_OF[x]
        return f"How many legs does {_a(x)} have?", \
            f"{_a(x).capitalize()} has {NUMBER_WORDS[n] if n else 'no'} {'leg' if n == 1 else 'legs'}."
    if kind == 3:
        x = rng.choice(list(HOME_OF))
        return f"Where does {_a(x)} live?", f"{_a(x).capitalize()} lives {HOME_OF[x]}."
    if kind == 4:
        x = rng.choice(list(OPPOSITE_OF))
        return f"What is the opposite of {x}?", f"The opposite of {x} is {OPPOSITE_OF[x]}."
    if kind == 5:
        a, b = rng.randrange(10), rng.randrange(10)
        return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
    if kind == 6:
        return rng.choice(["Hello!", "Hi!", "Hello, how are you?", "Good morning!"]), \
            rng.choice(["Hello! How can I help you today?", "Hi! I am happy to help."])
    if kind == 7:
        return rng.choice(["Who are you?", "What can you do?", "What are you?"]), SELF
    animal = rng.choice(ANIMALS)
    q = rng.choice([f"Tell me a story about {_a(animal)}.", f"Tell me a short story about {_a(animal)}.",
                    f"Can you tell me a story about {_a(animal)}?"])
    return q, story(rng, animal)


WORDS = sorted(set(NAMES) | set(ANIMALS) | set(PLACES) | set(THINGS) | set(COLORS))


def repeat_pair(rng: random.Random) -> tuple[str, str]:
    """"Repeat these words": every answer word is copied from the question (training data that
    rewards copying at every answer token, so the model learns to copy before it must retrieve).
    The words differ from each other, so the word before says which one comes next."""
    words = " ".join(rng.sample(WORDS, rng.randint(3, 12)))
    return f"Repeat these words: {words}", f"The words: {words}."


def number(rng: random.Random) -> str:
    """A 5-digit number with 5 different digits (so each digit says which one follows it)."""
    first = rng.choice("123456789")
    return first + "".join(rng.sample([d for d in "0123456789" if d != first], 4))


@dataclass(frozen=True)
class Task:
    """A retrieval question: the user message, the exact expected answer and its key facts."""

    kind: str  # "passkey" or "kv"
    prompt: str  # the user message
    answer: str  # what the assistant must say
    value: str  # the needle's number (the answer is right when it holds exactly this number)
    depth: float  # where the needle sits, 0 = start of the haystack, 1 = end


def _haystack(rng: random.Random, n_tokens: int, count: Callable[[str], int]) -> list[str]:
    """Story sentences (not whole stories: a sentence is the unit a needle goes between) whose
    token counts add up to about ``n_tokens``."""
    out, total = [], 0
    while total < n_tokens:
        for s in story(rng).replace(". ", ".\n").replace("! ", "!\n").replace("? ", "?\n").split("\n"):
            if total >= n_tokens:
                break
            out.append(s)
            total += count(" " + s)
    return out


def _insert(rng: random.Random, sentences: list[str], needles: list[tuple[float, str]],
            count: Callable[[str], int]) -> str:
    """Join ``sentences`` with each needle sentence placed at its depth (a fraction of tokens)."""
    cum, total = [], 0
    for s in sentences:
        cum.append(total)
        total += count(" " + s)
    out = list(sentences)
    for depth, needle in sorted(needles, reverse=True):
        at = next((i for i, c in enumerate(cum) if c >= depth * total), len(sentences))
        out.insert(at, needle)
    return " ".join(out)


def passkey_task(rng: random.Random, n_tokens: int, depth: float, count: Callable[[str], int]) -> Task:
    """The pass key (5 different digits) in a haystack of about ``n_tokens`` tokens, at ``depth``."""
    key = number(rng)
    head, question = "There is a pass key hidden in this text. Find it and remember it.", "What is the pass key?"
    needle = f"The pass key is {key}. Remember it."
    budget = n_tokens - count(head) - count(" " + needle) - count("\n" + question) - 12
    hay = _insert(rng, _haystack(rng, max(budget, 0), count), [(depth, needle)], count)
    return Task("passkey", f"{head}\n{hay}\n{question}", f"The pass key is {key}.", key, depth)


def kv_task(rng: random.Random, n_tokens: int, depth: float, count: Callable[[str], int], pairs: int = 4) -> Task:
    """Key–value lookup: ``pairs`` secret codes of different people, the asked one at ``depth``
    and the others at random depths."""
    names = rng.sample(list(NAMES), pairs)
    codes = [number(rng) for _ in names]
    head = "Some people in this text have secret codes. Remember them."
    question = f"What is the code for {names[0]}?"
    needles = [(depth, f"The code for {names[0]} is {codes[0]}.")]
    needles += [(rng.random(), f"The code for {n} is {c}.") for n, c in zip(names[1:], codes[1:])]
    budget = n_tokens - count(head) - sum(count(" " + s) for _, s in needles) - count("\n" + question) - 12
    hay = _insert(rng, _haystack(rng, max(budget, 0), count), needles, count)
    return Task("kv", f"{head}\n{hay}\n{question}", f"The code for {names[0]} is {codes[0]}.", codes[0], depth)


def is_right(task: Task, text: str) -> bool:
    """The answer holds the needle's number and no other number (the model's reply may be
    phrased differently from ``task.answer``)."""
    import re

    return re.findall(r"\d+", text) == [task.value]
