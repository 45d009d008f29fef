"""Long-context retrieval tasks, generated here from a seed and prose filler (no download), in the style of RULER:

- ``passkey``: a 5-digit pass key hidden at a chosen depth of the filler; the model is asked to repeat it.
- ``multikey``: four "special magic numbers", each for a different word, at random depths; the model is asked
  for one of them (the other three are distractors).
- ``vartrack``: variable tracking: ``VAR A = 12345``, then a chain ``VAR B = VAR A`` ... spread through the
  filler; the model is asked to name every variable that holds the value. Scored by the share of the chain's
  names it writes.

Every prompt is built in token ids: ``[BOS] intro filler... needle ... filler question``, the filler cut from a
long prose text at a seeded offset, so a sample has exactly the requested length whatever the tokenizer.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

TASKS = ("passkey", "multikey", "vartrack")
_WORDS = ("apple", "river", "candle", "forest", "violin", "harbor", "meadow", "lantern", "pepper", "glacier",
          "saddle", "copper", "falcon", "velvet", "orchid", "thunder", "marble", "compass", "walnut", "ember")
_INTRO = {
    "passkey": "There is an important pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
               "I will quiz you about the pass key.\n",
    "multikey": "Some special magic numbers are hidden inside the following text. Make sure to memorize them. "
                "I will quiz you about the numbers afterwards.\n",
    "vartrack": "Memorize and track the chain of variable assignment hidden in the following text.\n",
}


@dataclass
class TaskSample:
    """One prompt and what a correct answer contains.

    ``prompt_ids``: the token ids, exactly ``length`` of them; ``answers``: strings a correct output contains
    (passkey and multikey: one; vartrack: every variable of the chain, scored by the share found);
    ``depth``: where the (asked) needle sits in the filler, 0 = start, 1 = end."""

    task: str
    length: int
    depth: float
    prompt_ids: list[int]
    answers: list[str]
    index: int = 0
    meta: dict = field(default_factory=dict)

    def score(self, output: str) -> float:
        """1.0 when the output contains the answer (vartrack: the share of the chain's names it contains)."""
        return sum(answer in output for answer in self.answers) / len(self.answers)


def max_new_tokens(task: str) -> int:
    """Enough greedy tokens for the answer: a number, or a list of five variable names."""
    return 24 if task == "vartrack" else 10


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _fill(filler: Sequence[int], rng: random.Random, count: int) -> list[int]:
    if count > len(filler):
        raise ValueError(f"the filler text has {len(filler)} tokens; a prompt needs {count}: give a longer text")
    start = rng.randrange(0, len(filler) - count + 1)
    return list(filler[start:start + count])


def _assemble(tokenizer, filler, rng, length: int, intro: str, needles: list[tuple[float, str]],
              question: str) -> list[int]:
    """[BOS] intro, filler with the needles inserted at their depths (fractions of the filler), question;
    exactly ``length`` ids (the filler takes what the rest leaves)."""
    bos = [tokenizer.bos_token_id] if getattr(tokenizer, "bos_token_id", None) is not None else []
    head, tail = bos + _ids(tokenizer, intro), _ids(tokenizer, "\n" + question)
    pieces = [(depth, _ids(tokenizer, " " + text + " ")) for depth, text in needles]
    room = length - len(head) - len(tail) - sum(len(p) for _, p in pieces)
    if room < 16:
        raise ValueError(f"length={length} is too short for the task's text ({length - room} tokens)")
    body = _fill(filler, rng, room)
    # Insert from the deepest needle backwards so earlier cut points stay valid.
    for depth, piece in sorted(pieces, key=lambda x: -x[0]):
        cut = round(depth * room)
        body[cut:cut] = piece
    ids = head + body + tail
    assert len(ids) == length, (len(ids), length)
    return ids


def _number(rng: random.Random, digits: int = 5) -> str:
    return str(rng.randrange(10 ** (digits - 1), 10 ** digits))


def make_samples(task: str, tokenizer, filler: Sequence[int], length: int, count: int, seed: int = 0
                 ) -> list[TaskSample]:
    """``count`` samples of ``task`` at ``length`` tokens; the asked needle's depth runs evenly over 0..1."""
    if task not in TASKS:
        raise ValueError(f"task={task!r}; allowed: {', '.join(TASKS)}")
    if count < 1:
        raise ValueError(f"count={count} must be >= 1")
    samples = []
    for i in range(count):
        rng = random.Random(f"{task}/{length}/{seed}/{i}")
        depth = i / (count - 1) if count > 1 else 0.5
        if task == "passkey":
            key = _number(rng)
            needle = f"The pass key is {key}. Remember it. {key} is the pass key."
            ids = _assemble(tokenizer, filler, rng, length, _INTRO[task], [(depth, needle)],
                            "What is the pass key? The pass key is")
            samples.append(TaskSample(task, length, depth, ids, [key], i))
        elif task == "multikey":
            words = rng.sample(_WORDS, 4)
            numbers = [_number(rng, 7) for _ in words]
            depths = [depth] + [rng.random() for _ in words[1:]]
            needles = [(d, f"One of the special magic numbers for {w} is: {n}.")
                       for d, w, n in zip(depths, words, numbers)]
            ids = _assemble(tokenizer, filler, rng, length, _INTRO[task], needles,
                            f"What is the special magic number for {words[0]} mentioned in the provided text? "
                            f"The special magic number for {words[0]} mentioned in the provided text is")
            samples.append(TaskSample(task, length, depth, ids, [numbers[0]], i, {"distractors": numbers[1:]}))
        else:
            value = _number(rng)
            names = ["".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(4)) for _ in range(5)]
            chain = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
            # The chain starts at the sample's depth and spreads over what is left after it, in order.
            depths = [depth + (1 - depth) * j / len(chain) for j in range(len(chain))]
            ids = _assemble(tokenizer, filler, rng, length, _INTRO[task], list(zip(depths, chain)),
                            f"Question: Find all variables that are assigned the value {value} in the text above. "
                            f"Answer: According to the chain of variable assignments in the text above, 5 "
                            f"variables are assigned the value {value}, they are:")
            samples.append(TaskSample(task, length, depth, ids, names, i))
    return samples


def write_samples(path, samples: Sequence[TaskSample], tokenizer=None, *, seed: Optional[int] = None) -> Path:
    """The task file: one JSON line per sample (task, length, depth, index, seed, answers, max_new_tokens,
    prompt_ids, the prompt text when ``tokenizer`` is given, meta), so another program can run the very same
    prompts and score them the same way (``read_samples``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for s in samples:
            line = dict(task=s.task, length=s.length, depth=s.depth, index=s.index, seed=seed, answers=s.answers,
                        max_new_tokens=max_new_tokens(s.task), prompt_ids=list(s.prompt_ids), meta=s.meta)
            if tokenizer is not None:
                line["prompt"] = tokenizer.decode(s.prompt_ids, skip_special_tokens=True)
            f.write(json.dumps(line) + "\n")
    return path


def read_samples(path) -> list[TaskSample]:
    """The samples of a task file written by ``write_samples`` (a ValueError names a line that is not one)."""
    samples = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            sample = TaskSample(d["task"], int(d["length"]), float(d["depth"]), [int(i) for i in d["prompt_ids"]],
                                [str(a) for a in d["answers"]], int(d["index"]), d.get("meta") or {})
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{path}:{n}: not a task sample ({err})") from None
        if len(sample.prompt_ids) != sample.length or sample.task not in TASKS:
            raise ValueError(f"{path}:{n}: task {sample.task!r} with {len(sample.prompt_ids)} prompt ids for "
                             f"length {sample.length}")
        samples.append(sample)
    return samples
