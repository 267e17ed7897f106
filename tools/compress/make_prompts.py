"""Varied chat prompts for an EAGLE head's on-policy data (issue 49): templates x subjects across explanations,
how-tos, writing, code, arithmetic, advice and lists, plus summaries/rewrites of the Python standard library's own
docstrings; shuffled with a fixed seed so any prefix is as varied as the whole. The held-out questions
(tools/compress/eagle_prompts_eval.txt) are kept out: no subject of theirs appears (EXCLUDED is checked).

    python -m tools.compress.make_prompts --count 4000 --out /tmp/eagle2/prompts.txt
"""
from __future__ import annotations

import importlib
import inspect
import random
import warnings
from pathlib import Path

import click

SUBJECTS = """photosynthesis; black holes; the French Revolution; the Roman Empire; volcanoes; the immune system;
DNA replication; the water cycle; plate tectonics; the printing press; the Renaissance; the Industrial Revolution;
quantum computing; blockchain; machine learning; neural networks; the internet; cloud computing; encryption;
compound interest; inflation; supply and demand; the stock market; cryptocurrency; the electoral college;
the Cold War; ancient Egypt; the pyramids; the Silk Road; the Ming dynasty; the Aztecs; the Vikings;
the Byzantine Empire; World War I; the moon; Mars; Jupiter; comets; the Big Bang; dark matter; gravity;
electricity; magnetism; nuclear fusion; solar power; wind turbines; batteries; electric motors; semiconductors;
the human heart; the brain; vaccines; antibiotics; sleep cycles; nutrition labels; vitamins; the digestive system;
coral reefs; honeybees; dolphins; octopuses; elephants; wolves; penguins; ants; mushrooms; evolution;
natural selection; genetics; the periodic table; chemical bonds; acids and bases; oxidation; the speed of light;
relativity; thermodynamics; friction; sound waves; lasers; telescopes; microscopes; the Hubble telescope;
the Olympic Games; chess; jazz; classical music; the guitar; the violin; impressionist painting; Shakespeare;
Greek mythology; haiku poetry; the novel; photography; film editing; animation; video games; board games;
origami; knitting; pottery; gardening; composting; beekeeping; bread baking; fermentation; cheese making;
coffee roasting; tea ceremonies; chocolate; spices; the Mediterranean diet; sushi; pasta; democracy;
the United Nations; human rights; copyright; open source software; Linux; the Python language; databases;
SQL; version control; Git; recursion; sorting algorithms; binary search; hash tables; graphs; compilers;
operating systems; computer memory; GPUs; robotics; self-driving cars; 3D printing; drones; satellites; GPS;
the telephone; radio; television; the steam engine; railways; bridges; skyscrapers; dams; canals; lighthouses;
glaciers; deserts; the ocean floor; tides; hurricanes; earthquakes; tsunamis; the ozone layer; recycling;
renewable energy; deforestation; biodiversity; urban planning; public transport; architecture; gothic cathedrals;
the Great Wall of China; the Taj Mahal; Machu Picchu; Venice; Tokyo; Paris; Iceland; the Amazon river;
the Sahara; Antarctica; the Himalayas; languages of the world; sign language; writing systems; the alphabet;
mathematics; prime numbers; probability; statistics; geometry; calculus; fractals; infinity; logic puzzles;
philosophy; stoicism; ethics; psychology; habits; memory; motivation; leadership; teamwork; negotiation;
marketing; entrepreneurship; small businesses; taxes; banking; credit scores; insurance; mortgages;
volunteering; mindfulness; yoga; running; swimming; cycling races; football; basketball; tennis; mountaineering;
sailing; astronomy; meteors; the solar system; rockets; the International Space Station; exoplanets""".split(";")

PEOPLE = """a teacher; a nurse; a farmer; a programmer; a chef; a pilot; a librarian; a musician; a painter;
a detective; a young inventor; an old fisherman; a robot; a dragon; a talking fox; a lighthouse keeper;
a shy student; a retired astronaut; a street magician; a beekeeper""".split(";")

EVENTS = """finds a mysterious map; loses their voice before a big concert; meets a stranger on a train;
discovers a hidden room; has to save a small village; wins an unexpected prize; builds a machine that talks;
gets lost in a big city; learns to fly; finds an old letter""".split(";")

TASKS = """change a flat tire; learn to juggle; make a paper airplane; bake sourdough bread; brew a good cup of
tea; start running; learn to play the guitar; write a haiku; set up a Python virtual environment; use Git
branches; back up my computer; make my passwords safer; plan a birthday party; train a puppy; paint a room;
fix a leaky faucet; improve my handwriting; start a vegetable garden; learn to touch type; memorize a speech;
make friends in a new city; reduce my screen time; cook rice; sharpen a kitchen knife; start a podcast;
write a resume; negotiate a salary; read more books; learn chess openings; take better photos with my phone;
make a budget spreadsheet; clean a cast iron pan; choose a laptop; learn to swim; start journaling; meditate;
organize a community event; sew a button; tie a tie; remove a stain from a shirt""".split(";")

PY_TASKS = """reverses a string; checks whether a number is prime; counts the words in a text; computes the
factorial of n; returns the n-th Fibonacci number; removes duplicates from a list while keeping order; finds
the largest element of a list; flattens a nested list; checks whether a string is a palindrome; converts
Celsius to Fahrenheit; reads a CSV file and sums a column; computes the average of a list of numbers; finds
the most common element in a list; splits a list into chunks of size n; capitalizes every word in a sentence;
computes the greatest common divisor of two numbers; transposes a matrix; validates an email address with a
regular expression; counts vowels in a string; returns the intersection of two lists""".split(";")

LANG_PAIRS = """a list and a set in Python; a class and an object; a process and a thread; TCP and UDP; HTML and
CSS; a compiler and an interpreter; RAM and storage; a stack and a queue; SQL and NoSQL databases; Git merge
and Git rebase; == and is in Python; a function and a method; static and dynamic typing; an array and a
linked list; HTTP and HTTPS""".split(";")

PLACES = """Rome; Kyoto; Lisbon; New York; Cairo; Buenos Aires; Prague; Sydney; Istanbul; Vancouver; Marrakesh;
Edinburgh; Singapore; Mexico City; Vienna""".split(";")

RECIPIENTS = """my landlord; my manager; a customer; my neighbor; a professor; the city council; a hotel;
an old friend""".split(";")

EMAIL_SUBJECTS = """a broken heater; asking for a day off; a late delivery; a noisy party; an extension on a
deadline; a reservation change; a thank-you for their help; a meeting next week""".split(";")

PRODUCTS = """a reusable water bottle; noise-cancelling headphones; a smart thermostat; a hiking backpack;
a mechanical keyboard; an electric toothbrush; a solar lantern; a standing desk""".split(";")

CATEGORIES = """famous scientists; classic novels; musical instruments; programming languages; inventions of
the 20th century; mammals that live in the ocean; board games for families; famous painters; renewable energy
sources; ancient civilizations; types of clouds; kinds of pasta; Greek gods; planets and their moons;
sports played with a ball""".split(";")

EXPLAIN = ["Explain {s} in simple terms.", "What is {s}?", "How does {s} work?", "Tell me about {s}.",
           "Why does {s} matter?", "What are the main ideas behind {s}?", "Summarize {s} in three sentences.",
           "What are common misconceptions about {s}?", "Describe {s} to a high school student.",
           "What are the pros and cons of {s}?", "List five key facts about {s}.", "How has {s} changed over time?",
           "Who are some important people connected to {s}?", "Write a short paragraph about {s}.",
           "Give me a brief history of {s}.", "What are three interesting facts about {s}?",
           "How would you explain {s} to a child?", "What questions do scientists still have about {s}?",
           "What is the most surprising thing about {s}?", "How is {s} used in everyday life?",
           "Write a quiz with three questions about {s}.", "What should a beginner know about {s}?"]
COMPARE = ["Compare {s} and {t}.", "What do {s} and {t} have in common?", "How are {s} and {t} different?"]
HOWTO = ["How do I {k}?", "What are some tips to {k}?", "Give me step-by-step instructions to {k}.",
         "What mistakes should I avoid when I {k}?", "I want to {k}. Where do I start?"]
WRITING = ["Write a short poem about {s}.", "Write a haiku about {s}.", "Write a limerick about {s}.",
           "Write a short story about {p} who {e}.", "Write the opening paragraph of a novel about {p} who {e}.",
           "Write an email to {r} about {m}.", "Write a product description for {d}.",
           "Write a short advertisement for {d}.", "Write a tweet about {s}.", "Write a motivational message about {s}."]
CODE = ["Write a Python function that {f}.", "Write a JavaScript function that {f}.",
        "How would you write a function that {f}? Explain the steps.", "Write a Python function that {f}, with tests.",
        "What is the difference between {c}?", "Explain the difference between {c} with an example."]
ADVICE = ["What should I know before visiting {l}?", "Plan a three-day trip to {l}.", "What foods should I try in {l}?",
          "Recommend some books about {s}.", "What are good gift ideas for {p}?", "Name some famous {g}.",
          "Give me a list of {g}.", "Rank five {g} and explain your choice."]
DOC = ["Summarize the following text in one sentence:\n{x}", "Explain this documentation in plain words:\n{x}",
       "Rewrite this text so that a beginner understands it:\n{x}", "What does this describe?\n{x}"]

EXCLUDED = ("camping", "desk", "virus", "bacteri", "recipe for dinner", "airplane", "new language", "leaves",
            "refrigerator", "exercise", "cover letter", "thunder", "lightning", "glasses", "saving money", "purr",
            "submarine", "public speaking", "sky", "houseplant", "weather", "climate", "studying", "dream",
            "rainforest", "breakfast", "bicycle gear", "seasons", "used car", "friendship", "job interview",
            "microwave", "onion", "rainy day", "migrat")
DOC_MODULES = ("json", "os", "os.path", "re", "collections", "itertools", "functools", "pathlib", "random", "math",
               "statistics", "string", "textwrap", "datetime", "shutil", "subprocess", "heapq", "bisect", "csv",
               "argparse", "logging", "dataclasses", "typing", "urllib.parse", "hashlib", "base64", "zipfile",
               "tarfile", "tempfile", "threading", "queue", "socket", "sqlite3", "unittest", "difflib", "fractions",
               "decimal", "calendar", "enum", "contextlib", "inspect", "copy", "pickle", "struct", "uuid")


def _words(items: list[str]) -> list[str]:
    return [" ".join(i.split()) for i in items if i.strip()]


def doc_passages(limit: int = 400) -> list[str]:
    """First paragraphs (80-600 characters) of the standard library's public docstrings."""
    out = []
    for name in DOC_MODULES:
        module = importlib.import_module(name)
        for attr in sorted(dir(module)):
            with warnings.catch_warnings():  # typing's deprecated io/re namespaces warn when read
                warnings.simplefilter("ignore", DeprecationWarning)
                doc = inspect.getdoc(getattr(module, attr, None)) if not attr.startswith("_") else None
            first = " ".join(doc.split("\n\n")[0].split()) if doc else ""
            if 80 <= len(first) <= 600 and first not in out:
                out.append(first)
    return out[:limit]


def arithmetic(rng: random.Random) -> str:
    a, b, c = rng.randint(2, 99), rng.randint(2, 40), rng.randint(3, 500)
    return rng.choice([f"What is {a} times {b}?", f"Solve for x: {a}x + {b} = {c}.", f"What is {b}% of {c}?",
                       f"A train travels {c} km in {b} hours. What is its average speed?",
                       f"If I buy {b} apples at {a} cents each, how much do I pay?",
                       f"Is {c} a prime number? Explain.", f"What is {c} divided by {b}, with the remainder?",
                       f"A rectangle is {a} cm by {b} cm. What are its area and perimeter?"])


def make_prompts(count: int, seed: int = 0) -> list[str]:
    """`count` distinct prompts, shuffled by `seed`; none names an EXCLUDED subject."""
    rng = random.Random(seed)
    s, k, p, e = _words(SUBJECTS), _words(TASKS), _words(PEOPLE), _words(EVENTS)
    fill = dict(f=_words(PY_TASKS), c=_words(LANG_PAIRS), l=_words(PLACES), r=_words(RECIPIENTS),
                m=_words(EMAIL_SUBJECTS), d=_words(PRODUCTS), g=_words(CATEGORIES), x=doc_passages())
    kinds = [(EXPLAIN, 10), (COMPARE, 1), (HOWTO, 3), (WRITING, 3), (CODE, 2), (ADVICE, 2), (DOC, 2), (None, 1)]
    seen: set[str] = set()
    prompts: list[str] = []
    while len(prompts) < count:
        templates = rng.choices([t for t, _ in kinds], weights=[w for _, w in kinds])[0]
        if templates is None:
            prompt = arithmetic(rng)
        else:
            values = {"s": rng.choice(s), "t": rng.choice(s), "k": rng.choice(k), "p": rng.choice(p),
                      "e": rng.choice(e)} | {key: rng.choice(v) for key, v in fill.items()}
            prompt = rng.choice(templates).format(**values)
        if prompt not in seen and not any(word in prompt.lower() for word in EXCLUDED):
            seen.add(prompt)
            prompts.append(prompt)
    return prompts


@click.command()
@click.option("--count", default=4000, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--out", required=True, type=click.Path(path_type=Path))
def main(count, seed, out) -> None:
    """Write `count` prompts, one a line (a passage's newlines written as spaces), into --out."""
    lines = [" ".join(p.split("\n")) for p in make_prompts(count, seed)]
    out.write_text("# tools.compress.make_prompts --count %d --seed %d\n" % (count, seed) + "\n".join(lines) + "\n")
    click.echo(f"{len(lines)} prompts -> {out}")


if __name__ == "__main__":
    main()
