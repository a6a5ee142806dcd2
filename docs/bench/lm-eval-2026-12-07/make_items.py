"""Write items.jsonl: 60 multiple-choice questions made here (capitals, sums, opposites), a small task for checking
that lm-evaluation-harness scores the same through dartspec's server as on transformers."""

import json
import random
from pathlib import Path

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Japan": "Tokyo",
    "Egypt": "Cairo", "Canada": "Ottawa", "Kenya": "Nairobi", "Peru": "Lima", "Norway": "Oslo",
    "Greece": "Athens", "Poland": "Warsaw", "Russia": "Moscow", "Cuba": "Havana", "Ireland": "Dublin",
    "Portugal": "Lisbon", "Austria": "Vienna", "Sweden": "Stockholm", "Chile": "Santiago", "Thailand": "Bangkok",
}  # fmt: skip
OPPOSITES = {
    "hot": "cold", "big": "small", "fast": "slow", "up": "down", "happy": "sad", "light": "dark",
    "early": "late", "open": "closed", "full": "empty", "strong": "weak", "rich": "poor", "wet": "dry",
    "old": "young", "hard": "soft", "loud": "quiet", "first": "last", "tall": "short", "thick": "thin",
    "sharp": "dull", "clean": "dirty",
}  # fmt: skip


def main() -> None:
    rng = random.Random(7)
    items = []
    cities = list(CAPITALS.values())
    for country, city in CAPITALS.items():
        wrong = rng.sample([c for c in cities if c != city], 3)
        choices = rng.sample([city, *wrong], 4)
        question = f"What is the capital of {country}?"
        items.append({"question": question, "choices": choices, "answer": choices.index(city)})
    for _ in range(20):
        a, b = rng.randint(2, 40), rng.randint(2, 40)
        wrong = rng.sample([a + b + d for d in (-10, -2, -1, 1, 2, 10)], 3)
        choices = [str(x) for x in rng.sample([a + b, *wrong], 4)]
        items.append({"question": f"What is {a} + {b}?", "choices": choices, "answer": choices.index(str(a + b))})
    words = list(OPPOSITES.values())
    for word, opposite in OPPOSITES.items():
        wrong = rng.sample([w for w in words if w != opposite], 3)
        choices = rng.sample([opposite, *wrong], 4)
        question = f"What is the opposite of '{word}'?"
        items.append({"question": question, "choices": choices, "answer": choices.index(opposite)})
    out = Path(__file__).with_name("items.jsonl")
    out.write_text("".join(json.dumps(item) + "\n" for item in items))
    print(f"{len(items)} items -> {out}")


if __name__ == "__main__":
    main()
