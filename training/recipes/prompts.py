"""Deterministic generator of the project's prompt sets (no network, no model): a training set of instructions for
teacher self-distillation and a template-disjoint held-out evaluation set, part of it with checkable answers.

Run ``python -m unmask.training.recipes.prompts`` (or ``--out DIR``) to (re)write

* ``benchmarks/data/train_prompts.jsonl`` -- >= 2,000 instructions, one JSON object a line:
  ``{"id", "template", "category", "prompt"}``;
* ``benchmarks/data/eval_prompts.jsonl`` -- >= 200 held-out prompts ``{"id", "template", "category", "prompt",
  "answer"?, "meta"?}``; ``answer`` (a string) is present on checkable items and is compared by exact match after
  normalisation (``benchmarks/quality_metrics.normalize_answer``);
  ``meta`` carries the operands of arithmetic/conversion items so that tests can recompute the answer;
* ``benchmarks/data/eval_grid_ids.json`` -- the fixed 60-prompt subset used for the parallelism grid
  (``{"ids": [...], "quick_ids": [...]}``; ``quick_ids`` are its first 12, used by ``--quick``).

Rules (issue 5, docs/design.md#decisions "Evaluation"):

* every item records the id of the template that produced it; training templates are named ``train.*`` and
  evaluation templates ``eval.*``, and no template produces items for both sets (hand-written items have their own
  per-set template ids ``train.hand.<category>`` / ``eval.hand.<category>``); the texts are also checked for overlap;
* the checkable set is built before and independently of any model: nothing is filtered by the parent's success;
* all randomness comes from ``random.Random(crc32(template id) ^ SEED)``, so the output is byte-identical on every
  run and every machine (Python's ``hash`` is salted and is never used).
"""
from __future__ import annotations

import argparse
import json
import random
import zlib
from pathlib import Path

SEED = 20261130
REPO = Path(__file__).resolve().parents[2]
DATA_DIR = REPO / "benchmarks" / "data"
TRAIN_FILE = "train_prompts.jsonl"
EVAL_FILE = "eval_prompts.jsonl"
GRID_FILE = "eval_grid_ids.json"
EXTRA_FILE = "train_extra_prompts.jsonl"
GRID_SIZE = 60
QUICK_SIZE = 12

# ----------------------------------------------------------------------------------------------------- slot lists
TOPICS = [
    "photosynthesis", "gravity", "rainbows", "volcanoes", "earthquakes", "ocean tides", "the four seasons",
    "vaccines", "the immune system", "digestion", "sleep", "dreams", "muscles", "the human heart", "blood cells",
    "the lungs", "DNA", "evolution", "electricity", "magnets", "batteries", "solar panels", "wind turbines",
    "the internet", "email", "strong passwords", "encryption", "computer memory", "search engines", "GPS",
    "smartphones", "digital cameras", "microwave ovens", "refrigerators", "how airplanes fly", "why boats float",
    "bicycle gears", "car engines", "electric cars", "trains", "suspension bridges", "skyscrapers", "money",
    "banks", "interest on savings", "inflation", "taxes", "a household budget", "supply and demand", "recycling",
    "composting", "climate change", "the water cycle", "clouds", "snowflakes", "thunder", "lightning",
    "the phases of the moon", "solar eclipses", "stars", "the sun", "the planets", "black holes",
    "the speed of light", "sound waves", "echoes", "musical scales", "rhythm in music", "watercolor painting",
    "photography", "public libraries", "museums", "elections", "democracy", "laws", "juries", "maps",
    "time zones", "calendars", "leap years", "fractions", "percentages", "averages", "probability",
    "prime numbers", "triangles", "circles", "bread rising", "coffee", "green tea", "cheese making",
    "fermentation", "cooking pasta", "boiling water", "melting ice", "salt dissolving in water", "soap",
    "honey bees", "ant colonies", "bird migration", "how fish breathe", "trees", "flowers", "seeds sprouting",
    "deserts", "rainforests", "coral reefs", "rivers", "mountains", "glaciers", "friendship", "teamwork",
    "habits", "motivation", "stress", "regular exercise", "stretching", "a balanced diet", "vitamins",
    "drinking enough water", "washing hands", "first aid", "sunscreen", "the printing press", "the wheel",
    "ancient Egypt", "the Roman Empire", "the Olympic Games", "chess", "origami", "knitting", "gardening",
    "beekeeping", "volunteering", "public transport", "traffic lights", "recipes", "spreadsheets",
    "computer programs", "robots", "artificial intelligence", "3D printers", "satellites", "rockets",
    "the moon landing", "dinosaurs", "fossils", "earthworms", "penguins", "elephants", "octopuses",
]

ACTIVITIES = [
    "sleep better", "save money on groceries", "stay focused while studying", "keep houseplants alive",
    "make a good cup of tea", "prepare for a job interview", "learn a new language", "start running",
    "organize my desk", "remember people's names", "wake up earlier", "reduce my screen time", "cook rice",
    "clean a cast iron pan", "pack for a weekend trip", "write a thank-you note", "make friends in a new city",
    "stay warm in winter", "keep cool in summer", "take care of a puppy", "plan a birthday party",
    "choose a good book", "learn to swim", "fix a flat bicycle tire", "study for a math test",
    "calm down before a presentation", "drink more water", "eat more vegetables", "keep a journal",
    "start a small herb garden", "get better at drawing", "keep my kitchen clean", "save energy at home",
    "learn to type faster", "practice the guitar every day", "make my mornings less rushed",
    "be a better listener", "write clearer emails", "stop procrastinating", "read more books",
    "keep track of my spending", "prepare healthy lunches", "stay safe while hiking", "care for a cat",
    "decorate a small room", "learn basic cooking", "prepare for a long flight", "reduce food waste",
    "walk more each day", "improve my handwriting",
]

WRITING_SUBJECTS = [
    "a rainy afternoon", "a lost cat", "the first day of school", "a robot learning to paint",
    "a lighthouse keeper", "a quiet library", "autumn leaves", "the ocean at night", "a busy market",
    "a dragon who is afraid of the dark", "a snowy mountain village", "an old bicycle", "a kind neighbor",
    "a garden in spring", "a train journey", "a birthday cake", "a sleepy owl", "the city at dawn",
    "a forgotten umbrella", "a friendly ghost", "a small boat on a lake", "a summer picnic", "a broken clock",
    "a starry sky", "a brave little mouse", "a cup of hot chocolate", "a windy beach", "a treehouse",
    "a paper airplane", "a grandmother's kitchen", "a school science fair", "a thunderstorm", "a new puppy",
    "a long walk home", "a museum at midnight", "a field of sunflowers", "a cozy cabin", "a moving day",
    "a street musician", "the last day of summer",
]

PEOPLE = ["my teacher", "my neighbor", "my best friend", "my grandmother", "a coworker", "my coach", "my sister",
          "my landlord", "a new colleague", "my doctor", "my brother", "a customer", "my manager", "my uncle"]
THINGS_TO_THANK = ["helping me move", "the birthday gift", "a great dinner", "lending me a book",
                   "watering my plants", "the advice last week", "covering my shift", "the lovely flowers",
                   "driving me to the airport", "fixing my bike"]
EVENTS = ["our meeting", "dinner", "the movie", "practice", "the appointment", "class", "the party",
          "our video call", "the rehearsal", "lunch"]

LIST_CATEGORIES = [
    "fruits", "vegetables", "animals that live in the ocean", "colors", "musical instruments",
    "sports played with a ball", "things to pack for a beach trip", "kitchen tools", "board games", "birds",
    "countries in Europe", "breakfast foods", "hobbies you can do at home", "jobs in a hospital",
    "ways to save energy", "kinds of trees", "types of weather", "things that are yellow", "farm animals",
    "insects", "winter clothes", "school subjects", "tools in a toolbox", "things you find in a park",
    "healthy snacks", "ways to relax", "vehicles", "flowers", "desserts", "famous scientists",
    "things found in a bathroom", "reasons to learn to cook", "rainy-day activities", "office supplies",
    "programming languages", "herbs used in cooking", "shapes", "units of length", "dog breeds",
    "ways to be kind to others",
]

SENTENCES = [
    "The dog ran quickly across the yard.", "We are going to the store after lunch.",
    "She reads a book every night before bed.", "The meeting starts at nine in the morning.",
    "I think the movie was too long.", "They built a small house near the river.",
    "The children play soccer in the park on Saturdays.", "He forgot his keys at the office.",
    "Our team finished the project early.", "The weather is cold and windy today.",
    "My brother likes to cook spicy food.", "The train was late because of the snow.",
    "You need to send the report by Friday.", "The cat sleeps on the warm windowsill.",
    "We planted tomatoes in the garden.", "The shop closes at six o'clock.",
    "I can't find my phone anywhere.", "The students listened carefully to the teacher.",
    "This soup tastes really good.", "The museum is free on Sundays.",
    "He walks to work every day.", "The bakery sells fresh bread in the morning.",
    "She painted the fence blue.", "The baby laughed at the funny dog.",
    "Please turn off the lights when you leave.", "The computer is very slow today.",
    "We watched the sunset from the hill.", "The library has many old maps.",
    "My friend lives in a small town.", "The birds sing loudly in the spring.",
    "The price of coffee went up again.", "I want to learn how to play the piano.",
    "The bus was full of tourists.", "They cleaned the kitchen after dinner.",
    "The river flooded the low fields.", "Our neighbor has three noisy dogs.",
    "The new phone has a bigger screen.", "She wrote a letter to her aunt.",
    "The kids built a snowman in the yard.", "We missed the beginning of the concert.",
]

BAD_GRAMMAR = [
    "She go to school every day.", "They was happy with the result.", "He don't like apples.",
    "I has two brothers.", "The dogs is barking loudly.", "We goes to the beach yesterday.",
    "Me and him went to the store.", "She have a red car.", "There is many books on the shelf.",
    "He runned to the bus stop.", "I seen that movie last week.", "The childs are playing outside.",
    "She don't know the answer.", "We was late for class.", "He buyed a new hat.",
    "The informations are wrong.", "I am agree with you.", "They has finished their homework.",
    "It rain a lot in April.", "My sister cook dinner yesterday.",
]

NAMES = ["Anna", "Ben", "Carlos", "Diana", "Elena", "Farid", "Grace", "Hiro", "Isabel", "Jamal", "Kira", "Leo",
         "Maria", "Noah", "Olivia", "Pedro", "Quinn", "Rosa", "Sam", "Tara", "Umar", "Vera", "Wei", "Yusuf", "Zoe"]
PLACES = ["library", "bakery", "museum", "park", "station", "market", "gym", "beach", "office", "pharmacy",
          "cinema", "zoo", "harbor", "garden center", "post office"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
CITIES = ["Paris", "Tokyo", "Cairo", "Lima", "Oslo", "Toronto", "Sydney", "Nairobi", "Madrid", "Seoul",
          "Dublin", "Lisbon", "Vienna", "Mumbai", "Chicago"]
COLORS = ["red", "blue", "green", "yellow", "black", "white", "orange", "purple", "brown", "pink", "gray"]
OBJECTS = ["car", "door", "scarf", "umbrella", "bicycle", "kite", "mug", "backpack", "boat", "chair", "lamp"]
ITEMS = ["apples", "pencils", "books", "cookies", "stickers", "marbles", "cards", "eggs", "bottles", "shells"]

COMPARE_PAIRS = [("weather", "climate"), ("a virus", "bacteria"), ("a lake", "a river"), ("a frog", "a toad"),
                 ("thunder", "lightning"), ("a star", "a planet"), ("a city", "a village"), ("rain", "snow"),
                 ("a fruit", "a vegetable"), ("a bicycle", "a motorcycle"), ("a noun", "a verb"),
                 ("saving", "investing"), ("a cold", "the flu"), ("a tablet", "a laptop"), ("tea", "coffee"),
                 ("a poem", "a story"), ("a map", "a globe"), ("a moth", "a butterfly"), ("a hill", "a mountain"),
                 ("speed", "velocity"), ("a sea", "an ocean"), ("a dolphin", "a shark"), ("baking", "frying"),
                 ("an email", "a letter"), ("a doctor", "a nurse"), ("a rabbit", "a hare"),
                 ("a crocodile", "an alligator"), ("a square", "a rectangle"), ("a week", "a fortnight"),
                 ("a library", "a bookstore")]

# Capitals: disjoint country lists for the training and the evaluation templates.
CAPITALS_TRAIN = {"France": "Paris", "Italy": "Rome", "Spain": "Madrid", "Germany": "Berlin", "Egypt": "Cairo",
                  "Russia": "Moscow", "China": "Beijing", "India": "New Delhi", "Greece": "Athens",
                  "Ireland": "Dublin", "Portugal": "Lisbon", "Austria": "Vienna", "Kenya": "Nairobi",
                  "Argentina": "Buenos Aires", "Mexico": "Mexico City", "Thailand": "Bangkok"}
CAPITALS_EVAL = {"Japan": "Tokyo", "Norway": "Oslo", "Sweden": "Stockholm", "Peru": "Lima", "Poland": "Warsaw",
                 "Finland": "Helsinki", "Denmark": "Copenhagen", "Cuba": "Havana", "Hungary": "Budapest",
                 "South Korea": "Seoul", "the United Kingdom": "London", "Belgium": "Brussels"}
ANTONYMS_TRAIN = {"happy": "sad", "big": "small", "fast": "slow", "up": "down", "early": "late", "open": "closed",
                  "full": "empty", "rich": "poor", "strong": "weak", "young": "old", "loud": "quiet",
                  "heavy": "light", "wet": "dry", "first": "last", "inside": "outside"}
ANTONYMS_EVAL = {"hot": "cold", "tall": "short", "day": "night", "true": "false", "win": "lose",
                 "hard": "soft", "buy": "sell", "push": "pull", "left": "right", "north": "south",
                 "arrive": "leave", "begin": "end", "always": "never", "dark": "light", "love": "hate"}
PLURALS_EVAL = {"mouse": "mice", "child": "children", "tooth": "teeth", "foot": "feet", "goose": "geese",
                "man": "men", "woman": "women", "person": "people", "box": "boxes", "city": "cities",
                "knife": "knives", "leaf": "leaves", "bus": "buses", "baby": "babies", "wolf": "wolves"}
WORDS_FOR_SPELLING = ["banana", "window", "garden", "rocket", "pencil", "orange", "turtle", "candle", "silver",
                      "planet", "jacket", "mirror", "basket", "forest", "yellow", "zebra", "kitten", "island"]

# Unit conversions: (name, from unit plural, to unit plural, factor).
CONVERSIONS_TRAIN = [("km_m", "kilometers", "meters", 1000), ("h_min", "hours", "minutes", 60),
                     ("kg_g", "kilograms", "grams", 1000), ("ft_in", "feet", "inches", 12),
                     ("yr_months", "years", "months", 12), ("dozen", "dozens", "eggs", 12),
                     ("m_mm", "meters", "millimeters", 1000), ("l_cl", "liters", "centiliters", 100)]
CONVERSIONS_EVAL = [("min_s", "minutes", "seconds", 60), ("l_ml", "liters", "milliliters", 1000),
                    ("m_cm", "meters", "centimeters", 100), ("wk_days", "weeks", "days", 7),
                    ("day_h", "days", "hours", 24), ("cm_mm", "centimeters", "millimeters", 10)]


# ----------------------------------------------------------------------------------------------------- machinery
def _rng(template: str) -> random.Random:
    return random.Random(zlib.crc32(template.encode()) ^ SEED)


def _num(x: float) -> str:
    """Canonical decimal text of a number: integers without a point, others without trailing zeros."""
    if float(x).is_integer():
        return str(int(x))
    return f"{x:.6f}".rstrip("0").rstrip(".")


def _fill(template: str, count: int, make) -> list[dict]:
    """Draw up to ``count`` distinct items from ``make(rng) -> (prompt, extra dict)``; duplicates are redrawn."""
    rng = _rng(template)
    seen: set[str] = set()
    out: list[dict] = []
    tries = 0
    while len(out) < count and tries < count * 50:
        tries += 1
        prompt, extra = make(rng)
        if prompt in seen:
            continue
        seen.add(prompt)
        out.append({"template": template, "prompt": prompt, **extra})
    return out


def _open(fmt: str, **slots):
    """A maker for an open-ended template: ``fmt`` filled with one random choice per slot list."""
    def make(rng):
        return fmt.format(**{k: rng.choice(v) for k, v in slots.items()}), {}
    return make


# ----------------------------------------------------------------------------------------------------- training
def _train_templated() -> list[tuple[str, str, int, object]]:
    """(template id, category, count, maker) for the training set."""
    T: list[tuple[str, str, int, object]] = []

    def add(tid, cat, n, make):
        T.append((f"train.{tid}", cat, n, make))

    # explanations
    add("explain.simple", "explanation", 70, _open("Explain {t} in simple terms.", t=TOPICS))
    add("explain.kid", "explanation", 60, _open("Explain {t} to a ten-year-old.", t=TOPICS))
    add("explain.short", "explanation", 60, _open("Give a short explanation of {t}.", t=TOPICS))
    add("explain.why", "explanation", 50, _open("Why is it useful to understand {t}?", t=TOPICS))
    add("explain.facts", "explanation", 60, _open("What are three facts about {t}?", t=TOPICS))
    add("explain.interesting", "explanation", 50, _open("Tell me something interesting about {t}.", t=TOPICS))
    add("explain.paragraph", "explanation", 50, _open("Describe {t} in one paragraph.", t=TOPICS))
    add("explain.twosent", "explanation", 50, _open("Write two sentences about {t}.", t=TOPICS))
    add("explain.compare", "explanation", len(COMPARE_PAIRS),
        lambda r: (lambda a, b: (f"What is the difference between {a} and {b}?", {}))(*r.choice(COMPARE_PAIRS)))
    # everyday questions
    add("everyday.how", "everyday", 50, _open("How can I {a}?", a=ACTIVITIES))
    add("everyday.tips", "everyday", 50, _open("What are some tips to {a}?", a=ACTIVITIES))
    add("everyday.mistake", "everyday", 40, _open("What is a common mistake people make when they try to {a}?",
                                                   a=ACTIVITIES))
    add("everyday.time", "everyday", 40, _open("How long does it usually take to {a}?", a=ACTIVITIES))
    add("everyday.capital", "everyday", len(CAPITALS_TRAIN),
        lambda r: (f"What is the capital of {r.choice(list(CAPITALS_TRAIN))}?", {}))
    add("everyday.opposite", "everyday", len(ANTONYMS_TRAIN),
        lambda r: (f"What is the opposite of {r.choice(list(ANTONYMS_TRAIN))}?", {}))
    add("everyday.daybefore", "everyday", 7, _open("What day comes before {d}?", d=DAYS))
    add("everyday.monthafter", "everyday", 12, _open("Which month comes after {m}?", m=MONTHS))
    add("everyday.useword", "everyday", 18, _open("Use the word '{w}' in a sentence.", w=WORDS_FOR_SPELLING))
    # short writing
    add("write.poem", "writing", 40, _open("Write a short poem about {s}.", s=WRITING_SUBJECTS))
    add("write.haiku", "writing", 40, _open("Write a haiku about {s}.", s=WRITING_SUBJECTS))
    add("write.story2", "writing", 40, _open("Write a two-sentence story about {s}.", s=WRITING_SUBJECTS))
    add("write.describe", "writing", 40, _open("Write a short description of {s}.", s=WRITING_SUBJECTS))
    add("write.title", "writing", 35, _open("Suggest a title for a story about {s}.", s=WRITING_SUBJECTS))
    add("write.thanks", "writing", 60, _open("Write a short thank-you message to {p} for {t}.", p=PEOPLE,
                                             t=THINGS_TO_THANK))
    add("write.invite", "writing", 40, _open("Write a friendly invitation to {e} for {p}.", e=EVENTS, p=PEOPLE))
    add("write.slogan", "writing", 40, _open("Write a catchy slogan about {t}.", t=TOPICS))
    # lists
    add("list.list", "list", 60, _open("List {n} {c}.", n=["three", "four", "five"], c=LIST_CATEGORIES))
    add("list.name", "list", 60, _open("Name {n} {c}.", n=["three", "four", "five", "six"], c=LIST_CATEGORIES))
    add("list.give", "list", 50, _open("Give me a list of {n} {c}.", n=["three", "five"], c=LIST_CATEGORIES))
    add("list.steps", "list", 40, _open("What are the steps to {a}?", a=ACTIVITIES))
    add("list.proscons", "list", 40, _open("List two pros and two cons of {t}.", t=TOPICS))

    # arithmetic
    def arith(op):
        def make(r):
            if op == "+":
                a, b = r.randint(2, 99), r.randint(2, 99)
                return f"What is {a} + {b}?", {}
            if op == "-":
                a = r.randint(20, 199)
                b = r.randint(1, a - 1)
                return f"What is {a} - {b}?", {}
            if op == "*":
                a, b = r.randint(2, 15), r.randint(2, 12)
                return f"What is {a} times {b}?", {}
            if op == "calc":
                a, b = r.randint(11, 40), r.randint(2, 9)
                return f"Calculate {a} * {b}.", {}
            if op == "/":
                b = r.randint(2, 12)
                return f"What is {b * r.randint(2, 12)} divided by {b}?", {}
            p = r.choice([10, 20, 25, 50, 75])
            return f"What is {p}% of {r.choice([20, 40, 60, 80, 100, 120, 200, 400])}?", {}
        return make
    add("arith.add", "arithmetic", 60, arith("+"))
    add("arith.sub", "arithmetic", 60, arith("-"))
    add("arith.mul", "arithmetic", 60, arith("*"))
    add("arith.calc", "arithmetic", 40, arith("calc"))
    add("arith.div", "arithmetic", 50, arith("/"))
    add("arith.pct", "arithmetic", 30, arith("%"))
    add("arith.word_buy", "arithmetic", 50, lambda r: (
        f"{r.choice(NAMES)} has {r.randint(2, 30)} {r.choice(ITEMS)} and gets {r.randint(2, 30)} more. "
        f"How many does {r.choice(['he', 'she'])} have now?", {}))
    add("arith.word_boxes", "arithmetic", 40, lambda r: (
        f"A box holds {r.randint(3, 12)} {r.choice(ITEMS)}. How many are in {r.randint(2, 9)} boxes?", {}))
    add("arith.word_share", "arithmetic", 30, lambda r: (lambda k, n: (
        f"{k * n} {r.choice(ITEMS)} are shared equally among {n} friends. How many does each friend get?", {}))(
        r.randint(2, 9), r.randint(2, 6)))

    # unit conversions
    def conv(name, src, dst, factor):
        def make(r):
            n = r.randint(2, 30)
            return r.choice([f"How many {dst} are in {n} {src}?", f"Convert {n} {src} to {dst}."]), {}
        return make
    for c in CONVERSIONS_TRAIN:
        add(f"convert.{c[0]}", "conversion", 25, conv(*c))
    add("convert.temp", "conversion", 20, lambda r: (f"Convert {r.choice(range(0, 101, 5))} degrees Celsius "
                                                     "to Fahrenheit.", {}))
    # rewriting
    add("rewrite.formal", "rewriting", 40, _open("Rewrite this sentence to be more formal: \"{s}\"", s=SENTENCES))
    add("rewrite.shorter", "rewriting", 40, _open("Make this sentence shorter: \"{s}\"", s=SENTENCES))
    add("rewrite.past", "rewriting", 40, _open("Rewrite this sentence in the past tense: \"{s}\"", s=SENTENCES))
    add("rewrite.grammar", "rewriting", len(BAD_GRAMMAR), _open("Fix the grammar in this sentence: \"{s}\"",
                                                                s=BAD_GRAMMAR))
    add("rewrite.paraphrase", "rewriting", 40, _open("Paraphrase the following sentence: \"{s}\"", s=SENTENCES))
    add("rewrite.exciting", "rewriting", 35, _open("Rewrite this sentence so it sounds more exciting: \"{s}\"",
                                                   s=SENTENCES))
    # extraction
    add("extract.name", "extraction", 50, lambda r: (
        f"What is the name of the person in this sentence: \"{r.choice(NAMES)} went to the {r.choice(PLACES)} "
        f"on {r.choice(DAYS)}.\"", {}))
    add("extract.city", "extraction", 40, lambda r: (
        f"Which city is mentioned in this sentence: \"{r.choice(NAMES)} flew to {r.choice(CITIES)} to visit "
        f"{r.choice(['a friend', 'family', 'a museum', 'a conference'])}.\"", {}))
    add("extract.number", "extraction", 40, lambda r: (
        f"Find the number in this sentence: \"The {r.choice(PLACES)} has {r.randint(3, 250)} "
        f"{r.choice(['visitors', 'chairs', 'windows', 'plants', 'books'])} today.\"", {}))
    add("extract.keywords", "extraction", 40, _open("What are the key words in this sentence: \"{s}\"",
                                                    s=SENTENCES))
    add("extract.subject", "extraction", 35, _open("Who or what is the subject of this sentence: \"{s}\"",
                                                   s=SENTENCES))
    return T


TRAIN_HAND = {
    "everyday": [
        "What should I eat for breakfast before a long hike?", "Is it better to study in the morning or at night?",
        "How often should I water a cactus?", "What can I cook with eggs, spinach and cheese?",
        "How do I politely decline an invitation?", "What is a good gift for a friend who loves books?",
        "How do I know if milk has gone bad?", "Why do cats purr?", "Why is the sky blue?",
        "Why do leaves change color in autumn?", "How do I start a conversation with someone new?",
        "What should I do if I feel tired all afternoon?", "How can I make my small apartment feel bigger?",
        "What is a good way to celebrate a friend's promotion?", "How many hours of sleep do adults need?",
        "What is the best way to learn multiplication tables?", "How do I remove a coffee stain from a shirt?",
        "Why do we yawn?", "What should I bring to a picnic?", "How do I make a simple salad dressing?",
        "What is a polite way to ask a neighbor to be quieter?", "How can I keep my bike from rusting?",
        "What are good questions to ask at the end of an interview?", "How do I boil an egg?",
        "How do I make my phone battery last longer?", "Why do onions make people cry?",
        "What is the difference between weather and climate?", "How do I choose a ripe avocado?",
        "What should I do if I lock myself out of my house?", "How can I help a friend who is feeling sad?",
    ],
    "explanation": [
        "What is a noun?", "What does a thermometer measure?", "What is the job of a firefighter?",
        "What is a haiku?", "How do plants get water from the soil?", "What is a leap year and why do we have it?",
        "Why does ice float on water?", "What is the difference between a virus and bacteria?",
        "What is a verb? Give an example.", "What does recycle mean?", "What does a librarian do?",
        "What is an adjective?", "Why do we have day and night?", "What makes a sentence a question?",
        "Why do we need to brush our teeth?", "What is a budget?", "What does a compass do?",
        "How does a seed become a plant?", "What is the equator?", "What is a synonym?",
    ],
    "writing": [
        "Write a short note to remind my roommate to buy milk.", "Write a one-sentence motto for a bakery.",
        "Write a short welcome message for new members of a chess club.",
        "Write a two-line rhyme about brushing your teeth.", "Write a short weather report for a sunny day.",
        "Write a friendly out-of-office email reply.", "Write a short apology for missing a meeting.",
        "Write a birthday message for a coworker.", "Write a short product description for a water bottle.",
        "Write a tweet announcing a new coffee shop opening.", "Write a short bedtime story about a sleepy bear.",
        "Write a riddle about a clock.", "Write a short speech to thank volunteers.",
        "Write a postcard message from a beach holiday.", "Write a short review of a pizza restaurant.",
    ],
    "list": [
        "Name the four seasons.", "List the days of the week.", "List the primary colors.",
        "Name three things that need electricity.", "List five words that rhyme with cat.",
        "Name three animals that can fly.", "List four things you can do to stay healthy.",
        "Name the planets closest to the sun.", "List three ways to say hello.",
        "Name three fruits that are red.", "List some things you can recycle.",
        "Name three things people do on weekends.", "List the steps to make a paper airplane.",
        "Name three jobs that help people.", "List five things you might see at a farm.",
    ],
    "arithmetic": [
        "What is 7 plus 8?", "What is 100 minus 37?", "What is 9 times 9?", "What is half of 50?",
        "If I have 3 coins and find 4 more, how many coins do I have?",
        "A pizza has 8 slices and I eat 3. How many are left?", "What is 12 squared?",
        "What is the sum of 15, 20 and 25?", "How many minutes are in two and a half hours?",
        "If a shirt costs 20 dollars and is 25% off, what is the new price?",
        "What is 1000 divided by 8?", "What is the next even number after 48?",
    ],
    "rewriting": [
        "Rewrite 'gonna' and 'wanna' as proper English words.",
        "Turn this into a polite request: \"Give me the salt.\"",
        "Rewrite this in plain English: \"The meeting has been postponed until further notice.\"",
        "Make this sound friendlier: \"Your order is late.\"",
        "Rewrite this headline in lowercase: \"Local Team Wins Big Game\"",
        "Combine these into one sentence: \"It was raining. We stayed inside.\"",
        "Change this sentence to the future tense: \"I walk to school.\"",
        "Summarize in one sentence: \"The cat sat on the mat all morning. Then it ate lunch and went back to sleep.\"",
    ],
    "extraction": [
        "What is the main idea of this sentence: \"Exercise helps people feel better and sleep well.\"",
        "Which word in this list is an animal: chair, tiger, cloud, spoon?",
        "Which word is a color: table, green, river, phone?",
        "What time is mentioned in this sentence: \"The store opens at 8 a.m.\"",
        "Find the verb in this sentence: \"The dog barked at the mailman.\"",
        "Which of these is a fruit: carrot, potato, mango, onion?",
        "What are the two cities in this sentence: \"She moved from Rome to Berlin last year.\"",
        "Pull out the email address from this text: \"Contact us at help@example.com for support.\"",
    ],
}


# ----------------------------------------------------------------------------------------------------- evaluation
def _eval_templated() -> list[tuple[str, str, int, object]]:
    """(template id, category, count, maker) for the held-out set; makers of checkable templates put ``answer``
    (and ``meta`` where an answer can be recomputed) into the extra dict."""
    T: list[tuple[str, str, int, object]] = []

    def add(tid, cat, n, make):
        T.append((f"eval.{tid}", cat, n, make))

    only_num = " Answer with only the number."

    def ans(prompt, answer, **meta):
        extra = {"answer": str(answer)}
        if meta:
            extra["meta"] = meta
        return prompt, extra

    # checkable: arithmetic
    add("arith.add_words", "arithmetic", 6, lambda r: (lambda a, b: ans(
        f"Add {a} and {b}.{only_num}", a + b, op="add", a=a, b=b))(r.randint(2, 60), r.randint(2, 60)))
    add("arith.sub_words", "arithmetic", 6, lambda r: (lambda a, b: ans(
        f"Subtract {b} from {a}.{only_num}", a - b, op="sub", a=a, b=b))(r.randint(30, 99), r.randint(1, 29)))
    add("arith.mul_words", "arithmetic", 6, lambda r: (lambda a, b: ans(
        f"Multiply {a} by {b}.{only_num}", a * b, op="mul", a=a, b=b))(r.randint(2, 12), r.randint(2, 10)))
    add("arith.double", "arithmetic", 5, lambda r: (lambda a: ans(
        f"What do you get if you double {a}?{only_num}", 2 * a, op="mul", a=a, b=2))(r.randint(3, 50)))
    add("arith.half", "arithmetic", 5, lambda r: (lambda a: ans(
        f"What is half of {2 * a}?{only_num}", a, op="div", a=2 * a, b=2))(r.randint(3, 50)))
    add("arith.shop_total", "arithmetic", 5, lambda r: (lambda a, b: ans(
        f"A shop sold {a} cups in the morning and {b} cups in the afternoon. How many cups did it sell in total?"
        f"{only_num}", a + b, op="add", a=a, b=b))(r.randint(5, 40), r.randint(5, 40)))
    add("arith.larger", "arithmetic", 5, lambda r: (lambda a, b: ans(
        f"Which number is larger: {a} or {b}?{only_num}", max(a, b), op="max", a=a, b=b))(
        *r.sample(range(10, 100), 2)))
    add("arith.sequence", "arithmetic", 5, lambda r: (lambda a, d: ans(
        f"What number comes next in the sequence {a}, {a + d}, {a + 2 * d}, {a + 3 * d}?{only_num}", a + 4 * d,
        op="seq", a=a, b=d))(r.randint(1, 20), r.randint(2, 10)))

    # checkable: unit conversions
    def conv(name, src, dst, factor):
        def make(r):
            n = r.randint(2, 12)
            return ans(f"{n} {src} is how many {dst}?{only_num}", n * factor, op="mul", a=n, b=factor)
        return make
    for c in CONVERSIONS_EVAL:
        add(f"convert.{c[0]}", "conversion", 4, conv(*c))

    # checkable: facts and words
    add("fact.capital", "everyday", 8, lambda r: (lambda c: ans(
        f"Which city is the capital of {c}? Reply with the city name only.", CAPITALS_EVAL[c]))(
        r.choice(list(CAPITALS_EVAL))))
    add("word.antonym", "everyday", 6, lambda r: (lambda w: ans(
        f"Give the antonym of '{w}'. Reply with one word only.", ANTONYMS_EVAL[w]))(r.choice(list(ANTONYMS_EVAL))))
    add("word.plural", "everyday", 6, lambda r: (lambda w: ans(
        f"What is the plural form of '{w}'? Reply with one word only.", PLURALS_EVAL[w]))(
        r.choice(list(PLURALS_EVAL))))
    add("word.dayafter", "everyday", 4, lambda r: (lambda i: ans(
        f"What day of the week comes after {DAYS[i]}? Reply with one word only.", DAYS[(i + 1) % 7]))(
        r.randrange(7)))
    add("word.firstletter", "extraction", 4, lambda r: (lambda w: ans(
        f"What is the first letter of the word '{w}'? Reply with the letter only.", w[0]))(
        r.choice(WORDS_FOR_SPELLING)))

    # checkable: extraction
    add("extract.year", "extraction", 5, lambda r: (lambda y, what: ans(
        f"Read this sentence: \"The {what} opened to the public in {y} after years of work.\" "
        "In which year did it open? Reply with the year only.", y))(
        r.randint(1850, 2020), r.choice(["bridge", "museum", "library", "stadium", "railway", "theater"])))
    add("extract.day", "extraction", 5, lambda r: (lambda n, d, p: ans(
        f"Note: \"Hi {n}, the meeting at the {p} is moved to {d}. See you then!\" "
        "On which day is the meeting? Reply with the day only.", d))(
        r.choice(NAMES), r.choice(DAYS), r.choice(PLACES)))
    add("extract.color", "extraction", 5, lambda r: (lambda n, c, o: ans(
        f"In the sentence \"{n} painted the {o} {c} last weekend.\", what color is the {o}? "
        "Reply with one word only.", c))(r.choice(NAMES), r.choice(COLORS), r.choice(OBJECTS)))
    add("extract.sender", "extraction", 4, lambda r: (lambda a, b: ans(
        f"Who wrote this note? \"Dear {a}, thanks for the lovely evening. Best wishes, {b}\" "
        "Reply with the name only.", b))(*r.sample(NAMES, 2)))
    add("extract.cheapest", "extraction", 4, lambda r: (lambda items, prices: ans(
        "Here are some prices: " + ", ".join(f"{i} {p} dollars" for i, p in zip(items, prices))
        + ". Which item is the cheapest? Reply with the item name only.", items[prices.index(min(prices))]))(
        r.sample(["tea", "bread", "milk", "rice", "soap", "jam", "cheese", "butter"], 3), r.sample(range(2, 15), 3)))
    add("count.words", "extraction", 4, lambda r: (lambda s: ans(
        f"How many words are in this sentence: \"{s}\"?{only_num}", len(s.split()), op="words", text=s))(
        r.choice(SENTENCES)))

    # open-ended (no checkable answer; scored by agreement with the parent, perplexity and repetition)
    add("open.teach", "explanation", 6, _open("In a few sentences, teach me about {t}.", t=TOPICS))
    add("open.beginner", "explanation", 6, _open("What would a beginner need to know about {t}?", t=TOPICS))
    add("open.summary", "explanation", 6, _open("I'm curious about {t}. Can you summarize it briefly?", t=TOPICS))
    add("open.advice", "everyday", 6, _open("My friend wants to {a}. What advice would you give?", a=ACTIVITIES))
    add("open.firststep", "everyday", 6, _open("What is a simple first step to {a}?", a=ACTIVITIES))
    add("open.verse", "writing", 6, _open("Compose four lines of verse on the theme of {s}.", s=WRITING_SUBJECTS))
    add("open.opening", "writing", 6, _open("Write the opening line of a novel about {s}.", s=WRITING_SUBJECTS))
    add("open.late", "writing", 6, _open("Draft a polite text message telling {p} that you will be late for {e}.",
                                         p=PEOPLE, e=EVENTS))
    add("open.bullets", "list", 6, _open("Write a bulleted list with {n} {c}.", n=["three", "four"],
                                         c=LIST_CATEGORIES))
    add("open.examples", "list", 6, _open("Can you think of {n} examples of {c}? Put each on its own line.",
                                          n=["three", "five"], c=LIST_CATEGORIES))
    add("open.question", "rewriting", 6, _open("Turn this sentence into a question: \"{s}\"", s=SENTENCES))
    add("open.polite", "rewriting", 6, _open("Say this more politely: \"{s}\"", s=SENTENCES))
    add("open.child", "rewriting", 6, _open("Rewrite this sentence for a young child: \"{s}\"", s=SENTENCES))
    return T


EVAL_HAND_CHECKABLE = [
    ("How many legs does a spider have? Answer with only the number.", "8"),
    ("How many legs does an insect have? Answer with only the number.", "6"),
    ("How many days are there in a week? Answer with only the number.", "7"),
    ("How many months are there in a year? Answer with only the number.", "12"),
    ("How many continents are there on Earth? Answer with only the number.", "7"),
    ("At what temperature in degrees Celsius does water boil at sea level? Answer with only the number.", "100"),
    ("At what temperature in degrees Celsius does water freeze? Answer with only the number.", "0"),
    ("How many sides does a triangle have? Answer with only the number.", "3"),
    ("How many sides does a hexagon have? Answer with only the number.", "6"),
    ("How many minutes are in one hour? Answer with only the number.", "60"),
    ("How many hours are in one day? Answer with only the number.", "24"),
    ("How many letters are in the English alphabet? Answer with only the number.", "26"),
    ("What color do you get by mixing blue and yellow? Reply with one word only.", "green"),
    ("What color do you get by mixing red and white? Reply with one word only.", "pink"),
    ("What color is a ripe banana? Reply with one word only.", "yellow"),
    ("What is the largest planet in our solar system? Reply with one word only.", "Jupiter"),
    ("Which planet do we live on? Reply with one word only.", "Earth"),
    ("What is the closest star to the Earth? Reply with one word only.", "Sun"),
    ("What is frozen water called? Reply with one word only.", "ice"),
    ("What gas do plants take in from the air to make food? Reply with the name only.", "carbon dioxide"),
    ("Which animal is known as the king of the jungle? Reply with one word only.", "lion"),
    ("What do bees make? Reply with one word only.", "honey"),
    ("What is the first month of the year? Reply with one word only.", "January"),
    ("What is the last month of the year? Reply with one word only.", "December"),
    ("Which ocean is the largest? Reply with the name only.", "Pacific"),
    ("What is the opposite of 'yes'? Reply with one word only.", "no"),
    ("How many wheels does a bicycle have? Answer with only the number.", "2"),
    ("How many zeros are in one thousand? Answer with only the number.", "3"),
    ("What is the square root of 81? Answer with only the number.", "9"),
    ("What is ten percent of 300? Answer with only the number.", "30"),
]

EVAL_HAND_OPEN = {
    "everyday": ["What is a kind thing to do for a neighbor?", "How should I get ready for my first marathon?",
                 "What makes a good breakfast for a busy school morning?",
                 "Which is a better pet for a small apartment, a cat or a dog, and why?"],
    "explanation": ["Why do we see lightning before we hear thunder?", "How do bats find their way in the dark?",
                    "What is the purpose of a seatbelt?", "Why do some animals hibernate?"],
    "writing": ["Write a short note asking a friend to water your plants while you travel.",
                "Write a cheerful good-morning message for a team chat.",
                "Write a two-line poem that rhymes 'moon' with 'soon'."],
    "list": ["What should be in a basic first-aid kit?",
             "Name some things that make a classroom a good place to learn.",
             "What can people do to help keep the beach clean?"],
    "rewriting": ["Make this sentence more positive: \"The test was not easy.\"",
                  "Rewrite this as a headline: \"A local girl found a rare butterfly in her garden on Monday.\"",
                  "Shorten this to five words or fewer: \"We would like to invite you to come to our party.\""],
    "extraction": ["What is the topic of this sentence: \"Solar panels turn sunlight into electricity for homes.\"",
                   "List the foods mentioned here: \"For lunch we had soup, bread and a green salad.\"",
                   "What is the mood of this sentence: \"She jumped up and down when she heard the news.\""],
}


# ----------------------------------------------------------------------------------------------------- builders
def build_train() -> list[dict]:
    """The training prompts, in a fixed order, ids ``train-00000`` ... Duplicated prompt texts are dropped."""
    items: list[dict] = []
    for tid, cat, n, make in _train_templated():
        for it in _fill(tid, n, make):
            items.append({"template": tid, "category": cat, "prompt": it["prompt"]})
    for cat, prompts in TRAIN_HAND.items():
        items.extend({"template": f"train.hand.{cat}", "category": cat, "prompt": p} for p in prompts)
    return _number(_dedupe(items), "train")


def build_train_extra(factor: int = 4, seed: int = 1) -> list[dict]:
    """More training prompts from the same ``train.*`` templates: up to ``factor`` times each template's count,
    drawn with another seed, dropping every text already in the training or held-out set (so the evaluation stays
    template- and text-disjoint). Ids ``trainx-00000`` ...; hand-written prompts are not repeated. For data-hungry
    stages; ``factor=4`` gives 3,475 prompts (single-slot
    templates run out of new texts), ``factor=1`` 1,556.

    Raises:
        ValueError: ``factor`` < 1.
    """
    if factor < 1:
        raise ValueError("factor: must be >= 1")
    taken = {it["prompt"] for it in build_train()} | {it["prompt"] for it in build_eval()}
    items: list[dict] = []
    for tid, cat, n, make in _train_templated():
        rng = random.Random(zlib.crc32(tid.encode()) ^ SEED ^ (seed * 0x9E3779B1))
        got: set[str] = set()
        for _ in range(n * factor * 20):
            if len(got) >= n * factor:
                break
            prompt, _extra = make(rng)
            if prompt in taken or prompt in got:
                continue
            got.add(prompt)
            items.append({"template": tid, "category": cat, "prompt": prompt})
    return _number(items, "trainx")


def build_eval() -> list[dict]:
    """The held-out prompts, ids ``eval-0000`` ...; checkable items carry ``answer`` (and ``meta``)."""
    items: list[dict] = []
    for tid, cat, n, make in _eval_templated():
        for it in _fill(tid, n, make):
            row = {"template": tid, "category": cat, "prompt": it["prompt"]}
            if "answer" in it:
                row["answer"] = it["answer"]
            if "meta" in it:
                row["meta"] = it["meta"]
            items.append(row)
    for p, a in EVAL_HAND_CHECKABLE:
        items.append({"template": "eval.hand.checkable", "category": "everyday", "prompt": p, "answer": a})
    for cat, prompts in EVAL_HAND_OPEN.items():
        items.extend({"template": f"eval.hand.{cat}", "category": cat, "prompt": p} for p in prompts)
    return _number(_dedupe(items), "eval")


def _dedupe(items: list[dict]) -> list[dict]:
    seen, out = set(), []
    for it in items:
        if it["prompt"] not in seen:
            seen.add(it["prompt"])
            out.append(it)
    return out


def _number(items: list[dict], prefix: str) -> list[dict]:
    width = 4 if prefix == "eval" else 5
    return [{"id": f"{prefix}-{i:0{width}d}", **it} for i, it in enumerate(items)]


def grid_subset(eval_items: list[dict], size: int = GRID_SIZE, checkable_share: float = 0.6) -> list[str]:
    """Fixed grid subset: ``round(size * checkable_share)`` checkable and the rest open prompts, drawn round-robin
    over templates (so every template is represented before any repeats) in a seeded order. The first
    ``QUICK_SIZE`` ids interleave checkable and open items, so ``--quick`` sees both kinds."""
    rng = random.Random(SEED)
    n_check = round(size * checkable_share)

    def round_robin(rows: list[dict], n: int) -> list[str]:
        by_t: dict[str, list[str]] = {}
        for r in rows:
            by_t.setdefault(r["template"], []).append(r["id"])
        templates = sorted(by_t)
        rng.shuffle(templates)
        for t in templates:
            rng.shuffle(by_t[t])
        out: list[str] = []
        while len(out) < n and any(by_t.values()):
            for t in templates:
                if by_t[t] and len(out) < n:
                    out.append(by_t[t].pop())
        return out

    check = round_robin([r for r in eval_items if "answer" in r], n_check)
    opn = round_robin([r for r in eval_items if "answer" not in r], size - n_check)
    ids: list[str] = []
    ci, oi = iter(check), iter(opn)
    pattern = [ci, ci, oi] * size  # 2 checkable : 1 open, then whatever is left
    for src in pattern:
        nxt = next(src, None)
        if nxt is not None:
            ids.append(nxt)
    ids.extend(x for x in list(ci) + list(oi))
    return ids


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        for r in rows:
            fh.write(json.dumps(r, ensure_ascii=False, sort_keys=False) + "\n")
    tmp.replace(path)


def write_all(out_dir: str | Path = DATA_DIR) -> dict[str, Path]:
    """Write the three files into ``out_dir`` (created if missing). Returns their paths by name."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train, evals = build_train(), build_eval()
    ids = grid_subset(evals)
    _write_jsonl(out / TRAIN_FILE, train)
    _write_jsonl(out / EVAL_FILE, evals)
    grid = out / GRID_FILE
    grid.write_text(json.dumps({"ids": ids, "quick_ids": ids[:QUICK_SIZE]}, indent=1) + "\n", encoding="utf-8")
    return {"train": out / TRAIN_FILE, "eval": out / EVAL_FILE, "grid": grid}


def load_prompts(path: str | Path) -> list[dict]:
    """Read a prompt JSONL file (``{"id", "prompt", ...}`` per line).

    Raises:
        ValueError: ``file:line: reason`` for a line that is not a JSON object with a non-empty string ``prompt``
            and a string ``id``, or a duplicated id.
    """
    rows, seen = [], set()
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: not JSON ({exc.msg})") from exc
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
                raise ValueError(f"{path}:{n}: expected an object with a non-empty string 'prompt'")
            if not isinstance(row.get("id"), str):
                raise ValueError(f"{path}:{n}: expected a string 'id'")
            if row["id"] in seen:
                raise ValueError(f"{path}:{n}: duplicated id {row['id']!r}")
            seen.add(row["id"])
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    """CLI: write the train/eval prompt files and the grid ids to ``--out`` (default ``benchmarks/data``); returns 0."""
    ap = argparse.ArgumentParser(description="Write the train/eval prompt sets (deterministic, no network).")
    ap.add_argument("--out", default=str(DATA_DIR), help="output directory (default benchmarks/data)")
    ap.add_argument("--extra-train", type=int, default=0, metavar="FACTOR",
                    help=f"also write {EXTRA_FILE}: up to FACTOR x each training template's count of new prompts "
                         f"from the same templates (build_train_extra)")
    args = ap.parse_args(argv)
    if args.extra_train < 0:
        ap.error("--extra-train: must be >= 0")
    paths = write_all(args.out)
    if args.extra_train:
        paths["train_extra"] = Path(args.out) / EXTRA_FILE
        _write_jsonl(paths["train_extra"], build_train_extra(args.extra_train))
    for name, p in paths.items():
        print(f"{name}: {p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
