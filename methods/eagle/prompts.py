"""Training prompts for a self-distilled EAGLE head, all available offline and disjoint from the evaluation sets.

Three sources, each prompt tagged with its source (counted in the head's metrics):

- ``pydoc``: passages of the Python documentation's help topics (``pydoc_data.topics``, which ships with
  Python), with tasks like Spec-Bench's (summarise, explain, answer a question about it, translate a sentence).
- ``docstrings``: functions and classes of the standard library and their docstrings, as coding and
  explanation requests.
- ``templates``: writing, role-play, reasoning, arithmetic word problems, knowledge questions and extraction
  tasks composed from word lists written here, with seeded random numbers.

The target model answers every prompt itself (greedy): the head learns what this target says. Prompts that
share a run of ``ngram`` words with any evaluation question are dropped (:func:`drop_overlap`).
"""

from __future__ import annotations

import importlib
import inspect
import random
import re
from typing import Iterable

DOC_TASKS = (
    "Summarize the following text in a few sentences.\n\n{text}",
    "Explain the following passage in simple words, as if to a beginner.\n\n{text}",
    "Read the text below and answer: what is its main point, and why does it matter?\n\n{text}",
    "Write three questions a student could ask about this text, then answer them.\n\n{text}",
    "Based only on the following document, list the key facts it states.\n\nDocument: {text}",
    "Rewrite the following text so that it is shorter and clearer.\n\n{text}",
)
SENTENCE_TASKS = (
    "Translate into French: {text}",
    "Translate into German: {text}",
    "Translate into Spanish: {text}",
    "Paraphrase this sentence: {text}",
)
CODE_TASKS = (
    "Write a short Python example that uses `{name}` and explain it. Its documentation says:\n\n{doc}",
    "Explain what the Python {kind} `{name}` does and when to use it.",
    "Write a Python function that does the following, with a docstring: {summary}",
    "What are common mistakes when using `{name}` in Python?",
)
MODULES = (
    "abc argparse array ast base64 bisect calendar cmath codecs collections colorsys configparser contextlib copy "
    "csv dataclasses datetime decimal difflib email enum fnmatch fractions functools gettext glob gzip hashlib "
    "heapq hmac html io ipaddress itertools json locale logging math mimetypes numbers operator os pathlib pickle "
    "pprint queue random re sched secrets shelve shlex shutil socket sqlite3 statistics string struct subprocess "
    "tempfile textwrap threading time timeit tokenize tomllib types typing unicodedata unittest urllib.parse uuid "
    "warnings weakref zipfile zlib"
).split()

TOPICS = (
    "the ocean", "a small village", "friendship", "the first day of school", "a lost key", "autumn rain",
    "a robot learning to paint", "the history of bread", "climate change", "a mountain hike", "city traffic",
    "an old library", "learning a new language", "a rainy train station", "the moon landing", "a family dinner",
    "a garden in spring", "video games", "the internet", "a job interview", "an unexpected letter", "a bicycle trip",
    "honesty", "a thunderstorm", "space travel", "a street market", "coffee", "a broken phone", "the night sky",
    "a music festival", "volunteering", "a marathon", "recycling", "a snowy morning", "a museum visit",
)
FORMS = (
    "a short story", "a poem", "a blog post", "a persuasive paragraph", "a product description", "a haiku",
    "a diary entry", "a news report", "a speech", "an email to a friend", "a limerick", "a dialogue",
)
ROLES = (
    "a pirate captain", "a tour guide in Rome", "a medieval knight", "a friendly doctor", "a detective",
    "a chef", "a personal trainer", "a history teacher", "an astronaut", "a librarian", "a travel agent",
    "a customer support agent", "a career coach", "a gardener",
)
REQUESTS = (
    "Introduce yourself and describe a typical day.", "Give me advice for my first week.",
    "Tell me about the most difficult moment in your career.", "Explain your job to a child.",
    "Convince me to try your favourite activity.", "Describe the tools you use every day.",
)
CONCEPTS = (
    "photosynthesis", "inflation", "gravity", "the water cycle", "supply and demand", "machine learning",
    "the immune system", "plate tectonics", "compound interest", "democracy", "evolution", "electric current",
    "the greenhouse effect", "a binary search", "DNA", "the stock market", "vaccines", "black holes",
    "renewable energy", "the French Revolution", "the Roman Empire", "a recursive function", "blockchain",
    "the scientific method", "opportunity cost", "sound waves", "the printing press", "antibiotics",
    "a hash table", "the Industrial Revolution", "probability", "the human heart", "volcanoes", "tides",
)
QUESTIONS = (
    "What is {c}?", "Explain {c} in three sentences.", "Why is {c} important?", "Give two examples of {c}.",
    "How would you teach {c} to a ten-year-old?", "What are the advantages and disadvantages of {c}?",
    "Compare {c} and {d}.",
)
NAMES = ("Anna", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jonas", "Kira", "Liam")
ITEMS = ("apples", "books", "stamps", "pencils", "cookies", "marbles", "coins", "stickers", "shells", "cards")
WORD_PROBLEMS = (
    "{n} has {a} {i}. {m} gives {n} {b} more, and {n} then gives away {c}. How many {i} does {n} have now? "
    "Explain your reasoning step by step.",
    "A shop sells {i} at {a} dollars each. {n} buys {b} of them and pays with {c} dollars more than the total "
    "cost. How much money did {n} hand over? Think step by step.",
    "{n} reads {a} pages a day for {b} days, then {c} pages a day for {b} more days. How many pages did {n} read "
    "in total? Show your work.",
    "A train travels {a} kilometres per hour for {b} hours and then {c} kilometres per hour for one hour. How far "
    "does it travel? Solve step by step.",
    "{n} and {m} share {a} {i} so that {n} gets {b} more than {m}. How many does each get? Explain.",
)
REASONING = (
    "If all {x} are {y} and some {y} are {z}, can we conclude that some {x} are {z}? Explain.",
    "List the steps you would take to plan {t}.",
    "What could go wrong when organising {t}, and how would you prevent it?",
    "Give a balanced argument for and against {t}.",
)
EXTRACTION = (
    "Extract the names, dates and places from this text as a list: On {d} {n} travelled from {p} to {q} "
    "to meet {m}, who had arrived there two days earlier.",
    "Turn this into JSON with keys name, age and city: {n} is {a} years old and lives in {p}.",
)
PLACES = ("Lisbon", "Oslo", "Nairobi", "Lima", "Hanoi", "Toronto", "Dublin", "Seoul", "Cairo", "Perth", "Quito")


def _chunks(text: str, size: int) -> Iterable[str]:
    """Paragraph-aligned pieces of about ``size`` characters."""
    piece = ""
    for para in re.split(r"\n\s*\n", text):
        para = para.strip()
        if not para:
            continue
        if piece and len(piece) + len(para) > size:
            yield piece
            piece = ""
        piece = f"{piece}\n\n{para}" if piece else para[: 2 * size]
    if piece:
        yield piece


def pydoc_prompts(rng: random.Random, chunk_chars: int = 1200) -> list[str]:
    from pydoc_data.topics import topics

    prompts = []
    for name in sorted(topics):
        for chunk in _chunks(topics[name], chunk_chars):
            prompts.append(rng.choice(DOC_TASKS).format(text=chunk))
            sentences = [s for s in re.split(r"(?<=[.!?])\s+", chunk) if 40 < len(s) < 200 and "\n" not in s]
            if sentences:
                prompts.append(rng.choice(SENTENCE_TASKS).format(text=rng.choice(sentences)))
    return prompts


def docstring_prompts(rng: random.Random) -> list[str]:
    prompts = []
    for module_name in MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for attr in sorted(vars(module)):
            obj = getattr(module, attr)
            if attr.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            if not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj)):
                continue
            doc = inspect.getdoc(obj)
            if not doc or len(doc) < 40:
                continue
            summary = doc.split("\n\n")[0].replace("\n", " ")
            name = f"{module_name}.{attr}"
            task = rng.choice(CODE_TASKS)
            prompts.append(task.format(name=name, doc=doc[:800], summary=summary[:300],
                                       kind="class" if inspect.isclass(obj) else "function"))
    return prompts


def template_prompts(rng: random.Random, count: int) -> list[str]:
    def one() -> str:
        kind = rng.randrange(7)
        if kind == 0:
            return f"Write {rng.choice(FORMS)} about {rng.choice(TOPICS)}."
        if kind == 1:
            return f"Pretend you are {rng.choice(ROLES)}. {rng.choice(REQUESTS)}"
        if kind == 2:
            c, d = rng.sample(CONCEPTS, 2)
            return rng.choice(QUESTIONS).format(c=c, d=d)
        if kind == 3:
            n, m = rng.sample(NAMES, 2)
            a, b, c = rng.randint(5, 90), rng.randint(2, 30), rng.randint(1, 20)
            return rng.choice(WORD_PROBLEMS).format(n=n, m=m, a=a, b=b, c=c, i=rng.choice(ITEMS))
        if kind == 4:
            x, y, z = rng.sample(("cats", "birds", "students", "engineers", "poets", "runners", "doctors"), 3)
            return rng.choice(REASONING).format(x=x, y=y, z=z, t=rng.choice(TOPICS))
        if kind == 5:
            n, m = rng.sample(NAMES, 2)
            p, q = rng.sample(PLACES, 2)
            return rng.choice(EXTRACTION).format(n=n, m=m, p=p, q=q, a=rng.randint(18, 80),
                                                 d=f"{rng.randint(1, 28)} {rng.choice(('March', 'May', 'July'))}")
        return f"Write {rng.choice(FORMS)} that explains {rng.choice(CONCEPTS)}."

    return list(dict.fromkeys(one() for _ in range(count)))


def training_prompts(seed: int, sources: Iterable[str], templates: int) -> list[tuple[str, str]]:
    """(source, prompt) pairs of the named sources, deterministic given ``seed``, shuffled."""
    rng = random.Random(seed)
    makers = {"pydoc": lambda: pydoc_prompts(rng), "docstrings": lambda: docstring_prompts(rng),
              "templates": lambda: template_prompts(rng, templates)}
    unknown = sorted(set(sources) - set(makers))
    if unknown:
        raise ValueError(f"train.sources names {unknown}; known: {sorted(makers)}")
    pairs = [(source, prompt) for source in sources for prompt in makers[source]()]
    rng.shuffle(pairs)
    return pairs


def _ngrams(text: str, n: int) -> set[tuple[str, ...]]:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def drop_overlap(pairs: list[tuple[str, str]], evaluation: Iterable[str], ngram: int) -> tuple[list, int]:
    """Drop prompts sharing a run of ``ngram`` words with any evaluation text; (kept, dropped count)."""
    seen: set[tuple[str, ...]] = set()
    for text in evaluation:
        seen |= _ngrams(text, ngram)
    kept = [(s, p) for s, p in pairs if not (_ngrams(p, ngram) & seen)]
    return kept, len(pairs) - len(kept)
