"""The shop's product catalogue and its BM25 search index, generated from a seed.

WebShop (Yao et al. 2022) scrapes 1.18M Amazon products in 5 departments; this module builds a
structured stand-in offline: departments -> groups -> product types (the categories, 203 of them),
each product with a brand, a type, 2-4 attributes from its group's list, a price, and option
buttons (color, size, flavor, ...). What makes search and choice matter:

  * titles overlap: types share words across groups and departments ("running shoes" / "running
    shorts" / "trail running shoes", "coffee table" / "ground coffee"), groups share attributes,
    and each category draws its brands from a small pool;
  * hard negatives: products come in families of a base product and near copies that miss exactly
    one of its attributes (one swapped for another), and resellers' copies at 1.5-3x the price;
  * each listing offers about a third of its category's values of each option (a title can match
    while the wanted color is not offered: that shows only on the item page, as in WebShop).

Titles spell each attribute as a comma-separated phrase, so an attribute is in a title exactly when
the product has it (the reward's text check and the structured check agree). Option values are not
in the searchable text.

Search is BM25 (`bm25s`) over title + features, built once per (seed, size) and cached per process;
ties are broken by catalogue position, which is shuffled, so rankings are deterministic. 24k
products (the default) over 203 categories give about 120 per type. For a random goal (1-3 of a
random product's attributes, some of its options, its price bound) the best purchasable match of
the instruction's query is past results page 1 about 1 time in 20 (measured, 2000 goals); the task
generator (rollout/envs/shop.py) draws plan lengths uniformly, so such goals make its long tasks.
"""

from __future__ import annotations

import functools
import logging
import math
import random
from dataclasses import dataclass

import numpy as np

DEPARTMENTS = ("beauty", "electronics", "fashion", "food", "furniture")  # WebShop's five

COLORS = (
    "black",
    "white",
    "navy blue",
    "grey",
    "red",
    "green",
    "beige",
    "pink",
    "brown",
    "blue",
    "purple",
    "olive green",
    "khaki",
    "burgundy",
)
LETTER_SIZES = ("x-small", "small", "medium", "large", "x-large", "xx-large")
SHOE_SIZES = ("6", "6.5", "7", "7.5", "8", "8.5", "9", "9.5", "10", "11", "12")
FL_OZ = ("1 fl oz", "1.7 fl oz", "2 fl oz", "3.4 fl oz", "4 fl oz", "6.7 fl oz", "8 fl oz", "16 fl oz")
SCENTS = ("unscented", "lavender", "rose", "citrus", "coconut", "mint", "tea tree", "sandalwood")
SHADES = ("nude", "ruby red", "coral", "mauve", "berry", "ivory", "warm beige", "espresso brown")
PACKS = ("pack of 1", "pack of 2", "pack of 3", "pack of 4", "pack of 6", "pack of 12", "pack of 24")
FLAVORS = (
    "original",
    "sea salt",
    "barbecue",
    "honey roasted",
    "chocolate chip",
    "peanut butter",
    "spicy",
    "vanilla",
    "caramel",
    "lemon",
    "mixed berry",
    "cinnamon",
)
WEIGHTS = ("4 oz", "8 oz", "12 oz", "16 oz", "24 oz", "32 oz")
WOODS = ("walnut", "oak", "espresso", "white wash", "black", "grey", "natural", "cherry")
GADGET_COLORS = ("black", "white", "silver", "space grey", "blue", "red", "rose gold")
MODELS = ("iphone 14", "iphone 15", "iphone 15 pro", "galaxy s23", "galaxy s24", "pixel 8")
STYLES = ("standard", "compact", "pro", "max")
WIDTHS = ("narrow", "regular width", "wide width", "extra wide")
FITS = ("regular", "petite", "tall", "big and tall")
FURNITURE_SIZES = ("small", "medium", "large", "x-large")
LENGTHS = ("3 ft", "6 ft", "10 ft", "15 ft", "25 ft")
BED_SIZES = ("twin", "full", "queen", "king", "california king")
CAPACITY = ("32gb", "64gb", "128gb", "256gb", "512gb")

# department -> group -> (types, attributes, {option name: value pool}, (min, max) base price)
GROUPS: dict[str, dict[str, tuple]] = {
    "fashion": {
        "shoes": (
            (
                "running shoes",
                "trail running shoes",
                "walking shoes",
                "hiking boots",
                "ankle boots",
                "slip on sneakers",
                "canvas sneakers",
                "sandals",
                "flip flops",
            ),
            (
                "non slip",
                "water resistant",
                "lightweight",
                "breathable",
                "arch support",
                "memory foam",
                "rubber sole",
                "wide fit",
                "cushioned",
                "quick drying",
            ),
            {"color": COLORS, "size": SHOE_SIZES, "width": WIDTHS},
            (25, 120),
        ),
        "tops": (
            (
                "t shirt",
                "polo shirt",
                "button down shirt",
                "hoodie",
                "sweatshirt",
                "tank top",
                "long sleeve shirt",
                "blouse",
            ),
            (
                "machine washable",
                "moisture wicking",
                "slim fit",
                "relaxed fit",
                "cotton blend",
                "wrinkle free",
                "quick drying",
                "soft fabric",
                "short sleeve",
                "crew neck",
            ),
            {"color": COLORS, "size": LETTER_SIZES, "fit": FITS},
            (12, 60),
        ),
        "bottoms": (
            ("jeans", "cargo pants", "yoga pants", "running shorts", "joggers", "chino pants", "skirt", "leggings"),
            (
                "high waist",
                "stretch fabric",
                "machine washable",
                "slim fit",
                "relaxed fit",
                "elastic waistband",
                "moisture wicking",
                "deep pockets",
                "tummy control",
                "button closure",
            ),
            {"color": COLORS, "size": LETTER_SIZES, "fit": FITS},
            (15, 80),
        ),
        "outerwear": (
            (
                "rain jacket",
                "puffer jacket",
                "fleece jacket",
                "winter coat",
                "denim jacket",
                "softshell jacket",
                "vest",
            ),
            (
                "water resistant",
                "windproof",
                "hooded",
                "packable",
                "zipper closure",
                "insulated",
                "lightweight",
                "fleece lined",
                "machine washable",
                "quilted",
            ),
            {"color": COLORS, "size": LETTER_SIZES, "fit": FITS},
            (30, 160),
        ),
        "accessories": (
            ("baseball cap", "beanie", "scarf", "leather belt", "backpack", "wallet", "sunglasses", "gloves"),
            (
                "adjustable strap",
                "genuine leather",
                "rfid blocking",
                "uv protection",
                "one size",
                "lightweight",
                "water resistant",
                "polarized",
                "knit",
                "gift box",
            ),
            {"color": COLORS},
            (10, 70),
        ),
    },
    "beauty": {
        "skin care": (
            (
                "face moisturizer",
                "night cream",
                "eye cream",
                "face serum",
                "facial cleanser",
                "sunscreen",
                "toner",
                "face mask",
            ),
            (
                "hyaluronic acid",
                "vitamin c",
                "fragrance free",
                "paraben free",
                "oil free",
                "sensitive skin",
                "anti aging",
                "cruelty free",
                "dermatologist tested",
                "natural ingredients",
            ),
            {"size": FL_OZ, "scent": SCENTS},
            (8, 60),
        ),
        "hair care": (
            ("shampoo", "conditioner", "hair oil", "hair mask", "dry shampoo", "leave in conditioner", "hair spray"),
            (
                "sulfate free",
                "paraben free",
                "color safe",
                "argan oil",
                "curly hair",
                "dandruff control",
                "natural ingredients",
                "keratin",
                "volumizing",
                "dry hair",
            ),
            {"size": FL_OZ, "scent": SCENTS},
            (6, 40),
        ),
        "makeup": (
            (
                "lipstick",
                "lip gloss",
                "mascara",
                "liquid foundation",
                "eyeliner",
                "nail polish",
                "eyeshadow palette",
                "concealer",
            ),
            (
                "long lasting",
                "waterproof",
                "cruelty free",
                "vegan",
                "matte finish",
                "smudge proof",
                "highly pigmented",
                "paraben free",
                "easy to apply",
                "travel size",
            ),
            {"color": SHADES},
            (5, 45),
        ),
        "fragrance": (
            ("eau de parfum", "eau de toilette", "body mist", "cologne", "perfume oil"),
            (
                "long lasting",
                "floral scent",
                "woody scent",
                "fresh scent",
                "travel size",
                "gift set",
                "alcohol free",
                "natural ingredients",
            ),
            {"size": FL_OZ},
            (15, 120),
        ),
        "bath and body": (
            (
                "body wash",
                "body lotion",
                "hand cream",
                "bath bombs",
                "bar soap",
                "deodorant",
                "body scrub",
                "shower gel",
            ),
            (
                "shea butter",
                "aluminum free",
                "fragrance free",
                "sensitive skin",
                "moisturizing",
                "natural ingredients",
                "coconut oil",
                "cruelty free",
                "paraben free",
                "exfoliating",
            ),
            {"size": FL_OZ, "scent": SCENTS},
            (5, 35),
        ),
        "beauty tools": (
            ("hair dryer", "flat iron", "curling iron", "makeup brush set", "nail clipper"),
            (
                "ceramic",
                "fast drying",
                "ionic",
                "travel size",
                "auto shut off",
                "dual voltage",
                "stainless steel",
                "lightweight",
            ),
            {"color": GADGET_COLORS},
            (10, 90),
        ),
    },
    "electronics": {
        "audio": (
            (
                "wireless earbuds",
                "over ear headphones",
                "bluetooth speaker",
                "soundbar",
                "portable speaker",
                "noise cancelling headphones",
                "gaming headset",
            ),
            (
                "noise cancelling",
                "long battery life",
                "water resistant",
                "fast charging",
                "built in microphone",
                "deep bass",
                "touch control",
                "foldable",
                "usb c",
                "voice assistant",
            ),
            {"color": GADGET_COLORS},
            (20, 250),
        ),
        "phone accessories": (
            (
                "phone case",
                "screen protector",
                "wireless charger",
                "charging cable",
                "car phone mount",
                "power bank",
                "phone grip",
            ),
            (
                "shockproof",
                "fast charging",
                "usb c",
                "magnetic",
                "slim design",
                "tempered glass",
                "anti scratch",
                "high capacity",
                "compact",
                "military grade",
            ),
            {"color": GADGET_COLORS, "model": MODELS},
            (8, 50),
        ),
        "computer": (
            (
                "wireless mouse",
                "mechanical keyboard",
                "laptop stand",
                "usb hub",
                "webcam",
                "laptop sleeve",
                "monitor arm",
                "mouse pad",
            ),
            (
                "ergonomic",
                "adjustable height",
                "rgb backlit",
                "plug and play",
                "usb c",
                "quiet click",
                "rechargeable",
                "aluminum",
                "non slip base",
                "full hd",
            ),
            {"color": GADGET_COLORS, "style": STYLES},
            (12, 150),
        ),
        "camera": (
            ("action camera", "camera tripod", "memory card", "ring light", "camera bag", "lens filter"),
            (
                "4k",
                "waterproof",
                "image stabilization",
                "lightweight",
                "remote control",
                "high speed",
                "portable",
                "adjustable",
                "dimmable",
                "wide angle",
            ),
            {"color": GADGET_COLORS, "capacity": CAPACITY},
            (15, 300),
        ),
        "tv and video": (
            ("hdmi cable", "tv wall mount", "streaming stick", "universal remote", "hdmi switch", "tv antenna"),
            (
                "4k",
                "high speed",
                "easy installation",
                "braided",
                "tilting",
                "voice remote",
                "gold plated",
                "long range",
                "full motion",
                "hdr",
            ),
            {"length": LENGTHS},
            (8, 90),
        ),
        "smart home": (
            ("smart plug", "smart bulb", "security camera", "video doorbell", "smart thermostat", "motion sensor"),
            (
                "voice control",
                "works with alexa",
                "night vision",
                "two way audio",
                "energy saving",
                "easy installation",
                "motion detection",
                "wifi",
                "dimmable",
                "no hub required",
            ),
            {"color": GADGET_COLORS, "size": PACKS},
            (10, 200),
        ),
    },
    "food": {
        "snacks": (
            (
                "potato chips",
                "trail mix",
                "protein bars",
                "granola bars",
                "beef jerky",
                "popcorn",
                "pretzels",
                "mixed nuts",
                "rice cakes",
            ),
            (
                "gluten free",
                "low sugar",
                "high protein",
                "non gmo",
                "low sodium",
                "keto friendly",
                "vegan",
                "organic",
                "individually wrapped",
                "kosher",
            ),
            {"flavor": FLAVORS, "size": PACKS},
            (4, 35),
        ),
        "beverages": (
            (
                "green tea",
                "ground coffee",
                "coffee pods",
                "sparkling water",
                "hot cocoa",
                "herbal tea",
                "energy drink",
                "coconut water",
            ),
            (
                "organic",
                "decaf",
                "sugar free",
                "caffeine free",
                "fair trade",
                "zero calorie",
                "non gmo",
                "dark roast",
                "medium roast",
                "kosher",
            ),
            {"flavor": FLAVORS, "size": PACKS},
            (5, 40),
        ),
        "pantry": (
            (
                "olive oil",
                "pasta sauce",
                "peanut butter",
                "honey",
                "maple syrup",
                "hot sauce",
                "brown rice",
                "whole wheat pasta",
            ),
            (
                "organic",
                "extra virgin",
                "non gmo",
                "gluten free",
                "no sugar added",
                "kosher",
                "cold pressed",
                "raw",
                "low sodium",
                "vegan",
            ),
            {"size": WEIGHTS},
            (4, 30),
        ),
        "candy": (
            (
                "dark chocolate",
                "milk chocolate",
                "gummy bears",
                "hard candy",
                "chocolate truffles",
                "licorice",
                "lollipops",
            ),
            (
                "sugar free",
                "gluten free",
                "individually wrapped",
                "gift box",
                "vegan",
                "kosher",
                "fair trade",
                "nut free",
                "organic",
                "party size",
            ),
            {"flavor": FLAVORS, "size": WEIGHTS},
            (4, 40),
        ),
        "baking": (
            ("almond flour", "baking mix", "vanilla extract", "cake sprinkles", "cocoa powder", "baking soda"),
            ("gluten free", "organic", "non gmo", "keto friendly", "pure", "unsweetened", "vegan", "kosher"),
            {"size": WEIGHTS},
            (3, 25),
        ),
        "breakfast": (
            ("breakfast cereal", "oatmeal", "pancake mix", "granola"),
            (
                "whole grain",
                "high fiber",
                "low sugar",
                "gluten free",
                "organic",
                "high protein",
                "non gmo",
                "no artificial flavors",
            ),
            {"flavor": FLAVORS, "size": WEIGHTS},
            (3, 25),
        ),
    },
    "furniture": {
        "living room": (
            ("sofa", "accent chair", "coffee table", "side table", "tv stand", "bookshelf", "ottoman", "recliner"),
            (
                "solid wood",
                "easy assembly",
                "storage space",
                "mid century",
                "modern design",
                "upholstered",
                "metal frame",
                "tufted",
                "space saving",
                "rustic",
            ),
            {"color": WOODS, "size": FURNITURE_SIZES},
            (60, 700),
        ),
        "bedroom": (
            ("bed frame", "nightstand", "dresser", "headboard", "mattress", "vanity table", "wardrobe"),
            (
                "solid wood",
                "easy assembly",
                "storage drawers",
                "platform",
                "noise free",
                "upholstered",
                "metal frame",
                "mid century",
                "usb ports",
                "no box spring needed",
            ),
            {"color": WOODS, "size": BED_SIZES},
            (60, 800),
        ),
        "office": (
            ("office chair", "standing desk", "computer desk", "filing cabinet", "desk organizer", "gaming chair"),
            (
                "ergonomic",
                "adjustable height",
                "lumbar support",
                "easy assembly",
                "lockable",
                "swivel",
                "mesh back",
                "cable management",
                "steel frame",
                "home office",
            ),
            {"color": WOODS, "size": FURNITURE_SIZES},
            (30, 500),
        ),
        "dining": (
            ("dining table", "dining chairs", "bar stools", "kitchen island", "dining bench", "buffet cabinet"),
            (
                "solid wood",
                "set of 2",
                "set of 4",
                "upholstered",
                "counter height",
                "easy assembly",
                "farmhouse",
                "extendable",
                "metal legs",
                "modern design",
            ),
            {"color": WOODS, "size": FURNITURE_SIZES},
            (60, 700),
        ),
        "storage": (
            (
                "storage cabinet",
                "shoe rack",
                "storage bench",
                "wall shelf",
                "coat rack",
                "storage baskets",
                "closet organizer",
            ),
            (
                "space saving",
                "easy assembly",
                "wall mounted",
                "foldable",
                "stackable",
                "bamboo",
                "metal frame",
                "large capacity",
                "rustic",
                "multi tier",
            ),
            {"color": WOODS, "size": FURNITURE_SIZES},
            (15, 250),
        ),
        "outdoor": (
            ("patio chair", "garden bench", "hammock", "patio umbrella", "outdoor rug", "porch swing"),
            (
                "weather resistant",
                "uv resistant",
                "rust proof",
                "foldable",
                "easy assembly",
                "all weather",
                "cushioned",
                "portable",
                "acacia wood",
                "heavy duty",
            ),
            {"color": WOODS, "size": FURNITURE_SIZES},
            (30, 600),
        ),
    },
}
# Words after the type in some titles, per department (never an attribute, never a type word).
FILLERS = {
    "fashion": ("", "", "for women", "for men", "unisex", "classic"),
    "beauty": ("", "", "for women", "for men", "professional", "salon grade"),
    "electronics": ("", "", "2024 edition", "plus", "gen 2", "ultra"),
    "food": ("", "", "gourmet", "snack size", "family recipe", "premium"),
    "furniture": ("", "", "classic", "for home", "premium", "contemporary"),
}
OFFERED = 0.3  # chance that a listing offers a given value of its category's options
BUTTONS = ("back to search", "< prev", "next >", "description", "features", "buy now")


@dataclass(frozen=True)
class Category:
    index: int
    department: str
    group: str
    type: str  # the product type, a noun phrase ("running shoes")
    options: tuple[tuple[str, tuple[str, ...]], ...]  # (name, values offered), in page order
    price_range: tuple[float, float]

    @property
    def path(self) -> tuple[str, str, str]:
        """WebShop's product_category 'department > group > type' as its three parts."""
        return (self.department, self.group, self.type)


@dataclass(frozen=True)
class Product:
    index: int  # position in Catalog.products
    pid: str  # WebShop-style ASIN ("b0" + 8 characters), what results pages list and click[...] names
    category: int
    brand: str
    title: str
    attributes: frozenset[str]
    price: float
    options: tuple[tuple[str, tuple[str, ...]], ...]  # (name, values this listing offers), in page order
    features: tuple[str, ...]
    description: str


class Catalog:
    """Products, categories, the attribute index and the BM25 search of one seed."""

    def __init__(self, categories: list[Category], products: list[Product]):
        import bm25s  # the one dependency of search; imported here so importing the env is cheap

        logging.getLogger("bm25s").setLevel(logging.WARNING)  # it logs each index build at INFO

        self.categories, self.products = categories, products
        self.by_pid = {p.pid: p for p in products}
        by_attr: dict[str, list[int]] = {}
        for p in products:
            for a in p.attributes:
                by_attr.setdefault(a, []).append(p.index)
        self.by_attribute = {a: frozenset(ix) for a, ix in by_attr.items()}
        self._tokenizer = bm25s.tokenization.Tokenizer(stopwords="en")
        ids = self._tokenizer.tokenize([self.document(p) for p in products], show_progress=False, return_as="ids")
        self._bm25 = bm25s.BM25()
        self._bm25.index(ids, show_progress=False)

    @staticmethod
    def document(p: Product) -> str:
        """What search sees of a product: its title and feature bullets (WebShop indexes the page text)."""
        return p.title + " " + " ".join(p.features)

    def options(self, p: Product) -> tuple[tuple[str, tuple[str, ...]], ...]:
        return p.options

    def category_of(self, p: Product) -> Category:
        return self.categories[p.category]

    def search(self, query: str, k: int) -> list[int]:
        """Indices of the top-k products for `query` by BM25 score (> 0), ties by catalogue order."""
        q = self._tokenizer.tokenize([query], update_vocab=False, show_progress=False, return_as="ids")[0]
        q = [t for t in q if t != 0]  # 0 is bm25s's empty token (stopwords / unknown words only)
        if not q:
            return []
        scores = self._bm25.get_scores(q)
        cand = np.flatnonzero(scores > 0)  # ascending indices
        if k <= 0 or not len(cand):
            return []
        if len(cand) > k:  # keep everything scoring at least the k-th best (ties included)
            s = scores[cand]
            cand = cand[s >= np.partition(s, len(s) - k)[len(s) - k]]
        # stable: equal scores keep catalogue order, as a full stable argsort's first k would
        return cand[np.argsort(-scores[cand], kind="stable")][:k].tolist()


def _categories() -> list[Category]:
    cats = []
    for dept in DEPARTMENTS:
        for group, (types, _attrs, _opts, price) in GROUPS[dept].items():
            for t in types:
                cats.append((dept, group, t, price))
    return cats


def _brands(rng: random.Random, n: int) -> list[str]:
    onsets = ("b", "br", "c", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "ch", "tr")
    vowels = ("a", "e", "i", "o", "u", "ai", "ou")
    codas = ("", "n", "r", "x", "l", "s", "m")
    out: set[str] = set()
    while len(out) < n:
        w = "".join(rng.choice(onsets) + rng.choice(vowels) for _ in range(rng.choice((2, 2, 3))))
        out.add(w + rng.choice(codas))
    return sorted(out)


def _pid(rng: random.Random, taken: set[str]) -> str:
    """A fresh WebShop-style ASIN: "b0" and 8 base-36 characters."""
    chars = "0123456789abcdefghijklmnopqrstuvwxyz"
    while True:
        x, tail = rng.getrandbits(42), []
        for _ in range(8):
            x, d = divmod(x, 36)
            tail.append(chars[d])
        pid = "b0" + "".join(tail)
        if pid not in taken:
            taken.add(pid)
            return pid


def _price(rng: random.Random, lo: float, hi: float) -> float:
    """Log-uniform in [lo, hi], ending in .99 (or .49)."""
    x = math.exp(rng.uniform(math.log(lo), math.log(hi)))
    return math.floor(x) + rng.choice((0.99, 0.99, 0.49))


def _title(brand: str, type_: str, filler: str, attrs: list[str]) -> str:
    head = f"{brand} {type_}" + (f" {filler}" if filler else "")
    return ", ".join([head, *attrs])


@functools.lru_cache(maxsize=4)
def get_catalog(seed: int = 0, num_products: int = 24000) -> Catalog:
    """The catalogue of `seed` with about `num_products` products (>= one family per category).

    Cached per process: every ShopEnv with the same (seed, size) shares one catalogue and index.
    """
    if num_products < 1:
        raise ValueError(f"num_products must be >= 1, got {num_products}")
    rng = random.Random(f"shop-catalog-{seed}")
    raw = _categories()
    cats: list[Category] = []
    for i, (dept, group, t, price) in enumerate(raw):
        opts = []
        for name, pool in GROUPS[dept][group][2].items():
            n = min(len(pool), rng.randint(3, 6))
            keep = sorted(rng.sample(range(len(pool)), n))  # offered values keep the pool's order
            opts.append((name, tuple(pool[j] for j in keep)))
        lo = rng.uniform(price[0], (price[0] + price[1]) / 2)
        cats.append(Category(i, dept, group, t, tuple(opts), (lo, max(price[1], 4 * lo))))
    for c in cats:  # option values are click targets: unique on a page and never a fixed button
        values = [v for _, vs in c.options for v in vs]
        if len(set(values)) != len(values) or set(values) & set(BUTTONS):
            raise ValueError(f"category {c.type!r}: option values {values} repeat or name a button")
    brands = {d: _brands(rng, 60) for d in DEPARTMENTS}
    per_cat = max(1, math.ceil(num_products / len(cats)))
    taken: set[str] = set()
    rows: list[tuple] = []  # (category, brand, title, attrs, price, options, features, description)
    for c in cats:
        pool_attrs = GROUPS[c.department][c.group][1]
        cat_brands = rng.sample(brands[c.department], 12)
        made = 0
        while made < per_cat:
            brand, filler = rng.choice(cat_brands), rng.choice(FILLERS[c.department])
            attrs = rng.sample(pool_attrs, rng.choice((2, 3, 3, 4)))
            price = _price(rng, *c.price_range)
            family = [(brand, filler, attrs, price)]
            for _ in range(rng.choice((0, 1, 2, 3))):  # misses exactly one attribute (swapped for another)
                other = [a for a in pool_attrs if a not in attrs]
                j = rng.randrange(len(attrs))
                near = attrs[:j] + [rng.choice(other)] + attrs[j + 1 :]
                family.append((brand, filler, near, round(price * rng.uniform(0.9, 1.1)) - 0.01))
            for _ in range(rng.choice((0, 1, 2, 3))):  # copies by other sellers, 1.5-3x the price
                family.append(
                    (rng.choice(cat_brands), filler, list(attrs), math.floor(price * rng.uniform(1.5, 3.0)) + 0.99)
                )
            for brand_, filler_, attrs_, price_ in family[: per_cat - made]:
                # Each listing offers about a third (OFFERED) of its category's values of each option
                # (WebShop's listings differ too): a title can match while the wanted color is not offered.
                opts = tuple(
                    (name, tuple(v for v in vals if rng.random() < OFFERED) or (rng.choice(vals),))
                    for name, vals in c.options
                )
                shown = list(attrs_)
                rng.shuffle(shown)
                features = tuple(shown) + (f"{c.type} by {brand_}",)
                desc = (
                    f"the {brand_} {c.type} is {', '.join(shown[:-1])} and {shown[-1]}. "
                    f"a {c.group} essential from our {c.department} department."
                )
                rows.append(
                    (
                        c.index,
                        brand_,
                        _title(brand_, c.type, filler_, shown),
                        frozenset(attrs_),
                        max(price_, 1.99),
                        opts,
                        features,
                        desc,
                    )
                )
                made += 1
    rng.shuffle(rows)  # catalogue order breaks BM25 ties: shuffled, so ties are not by category
    products = [Product(i, _pid(rng, taken), *row) for i, row in enumerate(rows)]
    return Catalog(cats, products)
