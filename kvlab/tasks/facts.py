"""Facts to hide in a long text: templates, keys, and values of several shapes.

A fact is one English sentence, ``<Subject> is <value>.``, where the subject names a key ("the special magic number
for Lisbon"). The question that asks for it is ``What is <subject>?``. Several facts of one template with different
keys make a multi-key task; one key with several values (``One of <subjects> is <value>.``, asked as ``What are all
<subjects>?``, answered by the values in order, joined by ``", "``) makes a multi-value task, as in RULER.

Values come in three shapes (digits, words, identifiers) so that a model cannot pass by copying one kind of token.
Templates are split: :data:`TRAIN_TEMPLATES` (and the randomly composed subjects of :func:`composed_template`) may
appear in training data; :data:`HELD_OUT_TEMPLATES` never do, so accuracy on them measures retrieval of a phrasing
the model has not seen rather than a memorised question. Apart from articles and prepositions, no word of a held-out
subject occurs in a training subject.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

KeyKind = Literal["city", "person", "project"]
ValueKind = Literal["digits", "words", "identifier"]
VALUE_KINDS: tuple[ValueKind, ...] = ("digits", "words", "identifier")

CITIES: tuple[str, ...] = (
    "Lisbon",
    "Oslo",
    "Nairobi",
    "Lima",
    "Hanoi",
    "Dublin",
    "Quito",
    "Tunis",
    "Riga",
    "Perth",
    "Osaka",
    "Bergen",
    "Porto",
    "Kyoto",
    "Dakar",
    "Malmo",
    "Zagreb",
    "Tallinn",
    "Vilnius",
    "Bogota",
    "Havana",
    "Cairo",
    "Accra",
    "Lagos",
    "Seville",
    "Valencia",
    "Geneva",
    "Zurich",
    "Munich",
    "Hamburg",
    "Krakow",
    "Gdansk",
    "Prague",
    "Vienna",
    "Budapest",
    "Sofia",
    "Athens",
    "Ankara",
    "Tbilisi",
    "Yerevan",
    "Baku",
    "Tehran",
    "Karachi",
    "Dhaka",
    "Manila",
    "Jakarta",
    "Seoul",
    "Busan",
    "Taipei",
    "Sapporo",
    "Auckland",
    "Hobart",
    "Darwin",
    "Montreal",
    "Halifax",
    "Denver",
    "Boston",
    "Austin",
    "Phoenix",
    "Portland",
    "Santiago",
    "Montevideo",
    "Recife",
    "Cusco",
    "Antwerp",
)
PEOPLE: tuple[str, ...] = (
    "Maria",
    "Tomas",
    "Aisha",
    "Kenji",
    "Elena",
    "Omar",
    "Priya",
    "Lucas",
    "Ingrid",
    "Mateo",
    "Yuki",
    "Fatima",
    "Jonas",
    "Chloe",
    "Dmitri",
    "Amara",
    "Rafael",
    "Sofia",
    "Henrik",
    "Leila",
    "Pavel",
    "Nadia",
    "Victor",
    "Greta",
    "Samuel",
    "Ayumi",
    "Bruno",
    "Clara",
    "Diego",
    "Esther",
    "Felix",
    "Hana",
    "Ivan",
    "Julia",
    "Kofi",
    "Lars",
    "Mina",
    "Nils",
    "Olga",
    "Pedro",
    "Rosa",
    "Sven",
    "Tara",
    "Uma",
    "Walter",
    "Xenia",
    "Yara",
    "Zoran",
    "Astrid",
    "Boris",
    "Carmen",
    "Emil",
    "Freya",
    "Goran",
    "Hugo",
    "Irene",
    "Jasper",
    "Katya",
    "Leon",
    "Marta",
)
PROJECTS: tuple[str, ...] = (
    "Orion",
    "Atlas",
    "Nimbus",
    "Helios",
    "Vega",
    "Quasar",
    "Zephyr",
    "Cobalt",
    "Falcon",
    "Juniper",
    "Kestrel",
    "Lumen",
    "Meridian",
    "Nova",
    "Onyx",
    "Pulsar",
    "Quartz",
    "Raven",
    "Sierra",
    "Tundra",
    "Umbra",
    "Vertex",
    "Willow",
    "Xenon",
    "Yonder",
    "Zenith",
    "Aurora",
    "Borealis",
    "Cascade",
    "Dynamo",
    "Ember",
    "Fjord",
    "Granite",
    "Harbor",
    "Ion",
    "Jasmine",
    "Krypton",
    "Lotus",
    "Magnet",
    "Neptune",
    "Obsidian",
    "Polaris",
    "Rook",
    "Saffron",
)
ADJECTIVES: tuple[str, ...] = (
    "amber",
    "silver",
    "quiet",
    "golden",
    "crimson",
    "frozen",
    "gentle",
    "hollow",
    "ivory",
    "jagged",
    "lively",
    "marble",
    "narrow",
    "olive",
    "purple",
    "rapid",
    "scarlet",
    "tidy",
    "velvet",
    "wooden",
    "yellow",
    "brave",
    "cloudy",
    "dusty",
    "eager",
    "fuzzy",
    "glossy",
    "humble",
    "misty",
    "noble",
    "plain",
    "rusty",
    "sandy",
    "smooth",
    "sunny",
    "tiny",
    "vivid",
    "windy",
    "copper",
    "distant",
)
NOUNS: tuple[str, ...] = (
    "falcon",
    "lantern",
    "river",
    "meadow",
    "anchor",
    "beacon",
    "canyon",
    "dolphin",
    "engine",
    "forest",
    "garden",
    "harbor",
    "island",
    "jacket",
    "kettle",
    "ladder",
    "mirror",
    "needle",
    "orchard",
    "pebble",
    "quilt",
    "rocket",
    "saddle",
    "teapot",
    "umbrella",
    "violin",
    "walnut",
    "basket",
    "candle",
    "feather",
    "glacier",
    "hammer",
    "magnet",
    "pillow",
    "ribbon",
    "spoon",
    "tiger",
    "wagon",
    "bridge",
    "compass",
)
KEYS: dict[KeyKind, tuple[str, ...]] = {"city": CITIES, "person": PEOPLE, "project": PROJECTS}


@dataclass(frozen=True)
class Template:
    """How a fact about one key is stated and asked.

    ``subject`` and ``subjects`` (its plural, for multi-value facts) contain ``{key}`` and start with a lower-case
    article, since they are used inside sentences.
    """

    name: str
    subject: str
    subjects: str
    key_kind: KeyKind
    value_kind: ValueKind
    held_out: bool = False

    def statement(self, key: str, value: str) -> str:
        """The sentence that states a single-valued fact."""
        return f"{_capitalise(self.subject.format(key=key))} is {value}."

    def multi_statement(self, key: str, value: str) -> str:
        """The sentence that states one of several values of a key."""
        return f"One of {self.subjects.format(key=key)} is {value}."

    def question(self, key: str) -> str:
        """The question that asks for a single-valued fact."""
        return f"What is {self.subject.format(key=key)}?"

    def multi_question(self, key: str) -> str:
        """The question that asks for every value of a key."""
        return f"What are all {self.subjects.format(key=key)}?"


def _capitalise(text: str) -> str:
    return text[:1].upper() + text[1:]


TRAIN_TEMPLATES: tuple[Template, ...] = (
    Template(
        "magic-number", "the special magic number for {key}", "the special magic numbers for {key}", "city", "digits"
    ),
    Template("access-code", "the access code of {key}", "the access codes of {key}", "person", "identifier"),
    Template("secret-word", "the secret word chosen by {key}", "the secret words chosen by {key}", "person", "words"),
    Template(
        "registration",
        "the registration number of the {key} office",
        "the registration numbers of the {key} office",
        "city",
        "digits",
    ),
    Template(
        "password", "the password for the {key} account", "the passwords for the {key} account", "project", "identifier"
    ),
    Template(
        "colour-pair", "the favourite colour pair of {key}", "the favourite colour pairs of {key}", "person", "words"
    ),
    Template(
        "room-number", "the room number reserved for {key}", "the room numbers reserved for {key}", "person", "digits"
    ),
    Template(
        "tracking-id",
        "the tracking ID of the parcel sent to {key}",
        "the tracking IDs of the parcel sent to {key}",
        "city",
        "identifier",
    ),
    Template(
        "mission-codename",
        "the codename of the mission in {key}",
        "the codenames of the mission in {key}",
        "city",
        "words",
    ),
    Template(
        "serial-number",
        "the serial number of the {key} build",
        "the serial numbers of the {key} build",
        "project",
        "digits",
    ),
    Template(
        "release-tag", "the release tag of project {key}", "the release tags of project {key}", "project", "identifier"
    ),
    Template("team-motto", "the motto of the {key} team", "the mottos of the {key} team", "city", "words"),
    Template("phone-extension", "the phone extension of {key}", "the phone extensions of {key}", "person", "digits"),
    Template("licence-key", "the licence key for {key}", "the licence keys for {key}", "project", "identifier"),
    Template("lucky-animal", "the lucky animal of {key}", "the lucky animals of {key}", "person", "words"),
)
HELD_OUT_TEMPLATES: tuple[Template, ...] = (
    Template(
        "locker-combination",
        "the locker combination assigned to {key}",
        "the locker combinations assigned to {key}",
        "person",
        "digits",
        held_out=True,
    ),
    Template(
        "boarding-gate",
        "the boarding gate for the flight to {key}",
        "the boarding gates for the flight to {key}",
        "city",
        "identifier",
        held_out=True,
    ),
)
TEMPLATES: dict[str, Template] = {t.name: t for t in TRAIN_TEMPLATES + HELD_OUT_TEMPLATES}

_COMPOSED_ADJECTIVES = (
    "hidden",
    "primary",
    "backup",
    "private",
    "official",
    "current",
    "secret",
    "default",
    "emergency",
    "temporary",
)
_COMPOSED_NOUNS = ("number", "code", "token", "phrase", "label", "signal", "index", "pin", "badge", "keyword")
_COMPOSED_LINKS = ("for", "of", "used by", "linked to", "stored for", "issued to", "kept by")


def composed_template(rng: random.Random) -> Template:
    """A training-only template with a randomly composed subject, e.g. "the backup token issued to {key}".

    Hundreds of such subjects teach the model to match whatever subject the question names, rather than a fixed list
    of questions; that is what lets it answer a held-out template.
    """
    adjective, noun, link = rng.choice(_COMPOSED_ADJECTIVES), rng.choice(_COMPOSED_NOUNS), rng.choice(_COMPOSED_LINKS)
    key_kind: KeyKind = rng.choice(("city", "person", "project"))
    return Template(
        name="composed",
        subject=f"the {adjective} {noun} {link} {{key}}",
        subjects=f"the {adjective} {noun}s {link} {{key}}",
        key_kind=key_kind,
        value_kind=rng.choice(VALUE_KINDS),
    )


def make_value(kind: ValueKind, rng: random.Random) -> str:
    """A random value of one shape: ``4821903`` (digits), ``amber falcon`` (words) or ``QZ-4471-k9`` (identifier)."""
    if kind == "digits":
        length = rng.randint(5, 8)
        return str(rng.randint(10 ** (length - 1), 10**length - 1))
    if kind == "words":
        return f"{rng.choice(ADJECTIVES)} {rng.choice(NOUNS)}"
    upper = "ABCDEFGHJKLMNPQRSTUVWXYZ"
    lower = "abcdefghjkmnpqrstuvwxyz"
    if rng.random() < 0.5:
        letters = f"{rng.choice(upper)}{rng.choice(upper)}"
        return f"{letters}-{rng.randint(1000, 9999)}-{rng.choice(lower)}{rng.randint(1, 9)}"
    return f"{rng.choice(lower)}{rng.choice(lower)}{rng.randint(1, 9)}_{''.join(rng.choices(lower + '23456789', k=4))}"


@dataclass(frozen=True)
class Fact:
    """One key of one template with its value(s); several values make a multi-value fact."""

    template: Template
    key: str
    values: tuple[str, ...]

    @property
    def multi_value(self) -> bool:
        """Whether the fact is stated as several values of one key."""
        return len(self.values) > 1

    @property
    def statements(self) -> tuple[str, ...]:
        """The sentences to hide in the text: one, or one per value."""
        if self.multi_value:
            return tuple(self.template.multi_statement(self.key, v) for v in self.values)
        return (self.template.statement(self.key, self.values[0]),)

    @property
    def question(self) -> str:
        """The question that asks for this fact."""
        return self.template.multi_question(self.key) if self.multi_value else self.template.question(self.key)

    @property
    def answer(self) -> str:
        """The expected answer: the value, or the values in the order they are stated, joined by ``", "``."""
        return ", ".join(self.values)


def make_fact(
    template: Template,
    rng: random.Random,
    *,
    num_values: int = 1,
    avoid_keys: frozenset[str] = frozenset(),
    key: str | None = None,
) -> Fact:
    """A fact of ``template`` with a random key (not in ``avoid_keys``) and ``num_values`` distinct random values."""
    if key is None:
        choices = [k for k in KEYS[template.key_kind] if k not in avoid_keys]
        key = rng.choice(choices)
    values: list[str] = []
    while len(values) < num_values:
        value = make_value(template.value_kind, rng)
        if value not in values:
            values.append(value)
    return Fact(template, key, tuple(values))
