"""RULER-style synthetic long-context tasks, shared by training and evaluation.

Pure standard library on purpose: ``training/train_tiny_llama.py`` uses it with a lexicon of
pre-tokenized fragments (no ``transformers``/``tokenizers`` needed), while ``macattn eval`` uses
it with a real tokenizer. A sample is built from *fragments* (strings that each start at a pre-token
boundary) turned into token ids by an ``encode(fragment) -> list[int]`` callable, so training
(a lexicon of pre-tokenized fragments) and evaluation (``tokenizer.encode`` per fragment)
produce identical ids by construction.

Tasks (``TASKS``):
    niah_single   one "special magic number" needle in a text haystack; retrieve its value.
    niah_multikey four needles with distinct keys; retrieve the value of one of them.
    vt            variable tracking: a chain ``VAR a = 1234. VAR b = VAR a. ...`` spread in the
                  haystack; list every variable holding the value.
    cwe           common-word extraction: a long word list; name the three most frequent words.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Sequence

__all__ = ["TASKS", "KEY_WORDS", "VALUE_RANGE", "Sample", "all_fragments", "haystack_from", "make_sample",
           "check_lengths_and_tasks"]

VALUE_RANGE = (1000, 9999)  # values are 4-digit numbers written as one fragment " 1234"
TASKS = ("niah_single", "niah_multikey", "vt", "cwe")
TEMPLATE_FRAGMENTS = (
    "\n", "The special magic number for", " is", ".", "\nWhat is the special magic number for", "?",
    " Answer:", "\nVAR", " =", " VAR", "\nFind all variables that are assigned the value",
    "\nWords:", ",", "\nWhat are the three most common words in the list above?",
)

KEY_WORDS = tuple((
    "abel abigail abijah able abode abram absalom accuse added afflict ahimaaz almighty altar amalek "
    "amazed amen amorites angel anointed another appoint arise army ashamed ashdod assemble athaliah "
    "azariah baalim backward band bani bare basket basons bathe battle beast beasts beat became begat "
    "belial believe benjamin beseech bethel betray bloody boaz bodies boil bondage bondmen border "
    "both bought bowl branches breach breaches breadth breasts breath bright bring bringing builded "
    "buried burneth caesarea cain cakes calamity calves canaan captains carcase carmel carry casteth "
    "catch cause caused cave chambers changed charity children choice church cleanse cleansed cometh "
    "comfort common confess consider consume consumed contrary corner corners could council counted "
    "course courses creeping crucify crying cubit daily daniel darius dead deaf deceit declare deeds "
    "defence defile defiled deliver derision desire desolate devices dieth discern doctrine doest "
    "dogs door doors doth dove drank drink driven dwell east edge egyptian eight eighth eleven eliab "
    "elias elijah eliphaz endure ephesus equal esaias esau ever exodus ezra face faith false fasted "
    "feareth feed fetch fiery fill fine flame folly forbear forbid forgive forgiven forsaken fourteen "
    "fourth fowls free freely fruit fruitful full garments gath gather gathered gavest gaza gershon "
    "gilgal girded godly goeth golden granted grass graves greatly grieved grove groves guard hadst "
    "haman happy harps haste hated having hazor heap hearing heart heave heavenly hebrews height heir "
    "held heman hide highest hinder hiram hittites home honour hosea hosts hunger hungry husbands "
    "idol ignorant incline inherit insomuch inwards isaac ishmael israel itself jealousy jesus jewels "
    "jezebel josiah judge justice kind kindle know kohath lachish lame latter laws leaven left lest "
    "lewdness like likewise lions little locusts lodged loins longer loose loveth maachah made maker "
    "manner manoah marry masters matters measured measures meet members micaiah mind minister "
    "ministry miriam mizpah money months morrow mourn myrrh nadab naked naphtali nation nebat necks "
    "need needy neither nigh night nine nineveh ninth noon numbered obey obeyed occasion offence "
    "officers ointment ones open ordained order other over palm pass passover pasture patience "
    "perceive place places plagues plain plant please pleasure poured power praised praises prayed "
    "prepared prince privily promised proved pull purple purposed putteth quenched quickly rather "
    "rebuke reckoned reed rehoboam remain remember rent returned revealed rocks room royal rulers "
    "sailed saints sake sakes samuel sarai sayings sceptre scribe scribes sealed searched second seek "
    "seemed selfsame send sent serve served service seven shaken sheep shekels shem shepherd shew "
    "sheweth shewing shield shimei ship shittim shout sick sight sign signs sinners slew slothful "
    "smell smote sodom soever soldiers solemn songs sons sorrow sown spake speaketh spear speech "
    "spent spices staff standeth standing star statutes stay strive subdued succoth such suddenly "
    "suffered syrians taking talents tarshish taste teach tempest tenth thank that theirs these they "
    "thine thing this thorns time tobiah tower treasure tribes troubled true trust turned twenty "
    "twined under ungodly upon upper upright vineyard violence visited vows walk walked walking wars "
    "wash washed wast water wave ways west what whereas whole wholly whoso wind winds wings wise with "
    "withal withered wives woman wonder wonders wood word work worse would wound your zeal zerah ziba "
    "ziklag "
).split())


@dataclass(frozen=True)
class Sample:
    """One task instance.

    ids: prompt token ids (length == requested ``length`` minus the answer), ending just before
    the answer; answer: the expected continuation ids; task: the task name; question: the ids the
    prompt ends with that ask for the answer (``ids[-len(question):]``; what ``macattn eval --long-gen``
    asks again after a long generation).
    """

    task: str
    ids: list
    answer: list
    question: list = ()


def all_fragments() -> list[str]:
    """Every fragment a task can emit besides haystack text (what a training lexicon must hold)."""
    frags = list(TEMPLATE_FRAGMENTS)
    frags += [" " + w for w in KEY_WORDS]
    frags += [f" {v}" for v in range(VALUE_RANGE[0], VALUE_RANGE[1] + 1)]
    return frags


def _value(rng: random.Random) -> str:
    return f" {rng.randint(*VALUE_RANGE)}"


def _niah(rng: random.Random, n_keys: int):
    keys = rng.sample(KEY_WORDS, n_keys)
    vals = [_value(rng) for _ in keys]
    needles = [["\n", "The special magic number for", " " + k, " is", v, "."] for k, v in zip(keys, vals)]
    q = rng.randrange(n_keys)
    query = ["\nWhat is the special magic number for", " " + keys[q], "?", " Answer:"]
    return needles, query, [vals[q]]


def _vt(rng: random.Random, hops: int = 4):
    names = rng.sample(KEY_WORDS, hops + 2)
    val = _value(rng)
    needles = [["\nVAR", " " + names[0], " =", val, "."]]
    needles += [["\nVAR", " " + names[i], " =", " VAR", " " + names[i - 1], "."] for i in range(1, hops)]
    # a distractor chain with another value, so copying "the only number" is not enough
    other = _value(rng)
    needles += [["\nVAR", " " + names[hops], " =", other, "."],
                ["\nVAR", " " + names[hops + 1], " =", " VAR", " " + names[hops], "."]]
    query = ["\nFind all variables that are assigned the value", val, "?", " Answer:"]
    return needles, query, [" " + n for n in names[:hops]]


def haystack_from(ids: Sequence[int]) -> Callable[[int, random.Random], list]:
    """A ``haystack(n, rng)`` for ``make_sample``: ``n`` consecutive ids of ``ids`` from a random
    start, wrapping around when ``ids`` is shorter than ``n``."""
    ids = list(ids)
    if not ids:
        raise ValueError("haystack ids must not be empty")

    def hay(n: int, rng: random.Random) -> list:
        start = rng.randrange(0, max(1, len(ids) - n))
        out = ids[start:start + n]
        while len(out) < n:
            out += ids[: n - len(out)]
        return out
    return hay


def _fit_error(task: str, length: int, fixed: int) -> ValueError:
    return ValueError(f"length={length} is too short for task {task!r}: needs more than {fixed} tokens")


def make_sample(task: str, length: int, rng: random.Random, encode: Callable[[str], Sequence[int]],
                haystack: Callable[[int, random.Random], Sequence[int]], bos: Sequence[int] = ()) -> Sample:
    """Build one ``task`` sample whose prompt + answer is exactly ``length`` tokens.

    encode: fragment -> ids. haystack(n, rng) -> n filler token ids (ignored by ``cwe``).
    bos: ids to put first. Needles go at uniformly random depths of the haystack.
    """
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    if not isinstance(length, int) or length < 1:
        raise ValueError(f"length must be a positive int, got {length!r}")
    enc = lambda frags: [t for f in frags for t in encode(f)]  # noqa: E731
    if task == "cwe":
        return _cwe(length, rng, enc, bos)
    needles, query, answer = _niah(rng, 1 if task == "niah_single" else 4) if task != "vt" else _vt(rng)
    n_ids = [enc(n) for n in needles]
    q_ids, a_ids = enc(query), enc(answer)
    fixed = len(bos) + sum(map(len, n_ids)) + len(q_ids) + len(a_ids)
    if fixed >= length:
        raise _fit_error(task, length, fixed)
    hay = list(haystack(length - fixed, rng))
    cuts = sorted(rng.randint(0, len(hay)) for _ in n_ids)
    if task == "vt":
        order = list(range(len(n_ids)))  # chain order must hold: a definition precedes its use
    else:
        order = rng.sample(range(len(n_ids)), len(n_ids))
    ids, prev = list(bos), 0
    for cut, j in zip(cuts, order):
        ids += hay[prev:cut] + n_ids[j]
        prev = cut
    ids += hay[prev:] + q_ids
    return Sample(task, ids, a_ids, q_ids)


def _cwe(length, rng, enc, bos) -> Sample:
    words = rng.sample(KEY_WORDS, 3 + 60)
    top, rest = words[:3], words[3:]
    query = enc(["\nWhat are the three most common words in the list above?", " Answer:"])
    answer = enc([" " + w for w in top])
    head = list(bos) + enc(["\nWords:"])
    budget = length - len(head) - len(query) - len(answer)
    per_word = max(len(enc([" " + w, ","])) for w in words)
    n_items = budget // per_word
    if n_items < 12:
        raise _fit_error("cwe", length, len(head) + len(query) + len(answer) + 12 * per_word)
    # top words take ~30% of the list in counts 3:2:1-ish plus a margin over any distractor
    n_top = max(6, n_items * 3 // 10)
    counts = [n_top // 2, n_top // 3, n_top - n_top // 2 - n_top // 3]
    items = [w for w, c in zip(top, counts) for _ in range(c)]
    n_rest = n_items - len(items)
    cap = max(1, min(counts) - 1)  # every distractor strictly below the least common top word
    items += [rest[i % len(rest)] for i in range(min(n_rest, cap * len(rest)))]
    rng.shuffle(items)
    ids = list(head)
    for w in items:
        ids += enc([" " + w, ","])
    # pad up to the exact length with the list header repeated (neutral filler)
    filler = enc(["\n"])
    while len(ids) + len(query) + len(answer) < length:
        ids += filler
    ids = ids[: length - len(query) - len(answer)] + query
    return Sample("cwe", ids, answer, query)


def check_lengths_and_tasks(lengths: tuple, tasks: tuple) -> None:
    """An evaluation's sample plan: prompt lengths (ints >= 64) and a non-empty subset of ``TASKS``."""
    if not lengths or any(isinstance(x, bool) or not isinstance(x, int) or x < 64 for x in lengths):
        raise ValueError(f"lengths must be ints >= 64, got {lengths}")
    bad = [t for t in tasks if t not in TASKS]
    if bad or not tasks:
        raise ValueError(f"tasks must be a non-empty subset of {TASKS}, got {tasks}")
