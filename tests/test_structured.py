import datetime, json, math, random, re, uuid

import numpy as np
import pytest, torch
from hypothesis import given, settings, strategies as st

from nanoserve.structured import (DEAD, DFA, FINAL, JSON_OBJECT_DEPTH, NFA, ConstraintState, StructuredOutputs, TokenConstraint,
                                  compile_structured, greedy_structured, integer_range, json_schema_regex, parse_regex, utf8_sequences,
                                  vocabulary_bytes)
from nanoserve.tokenizer import load_tokenizer

regex = pytest.importorskip("regex")  # partial matching: an oracle for "a prefix of some match", independent of ours


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def vocab(tok):
    return vocabulary_bytes(tok, tok.vocab_size)


def matches(pattern: str, text: str) -> bool:
    "Our automaton's verdict on the whole text."
    dfa = DFA(pattern)
    return dfa.accepting[dfa.step(dfa.start, text.encode())]


# ---------------------------------------------------------------- the regex: against Python's re

PATTERNS = [
    "abc", "a|b(c|d)*", "[^a-z]+x{2,3}", r"\d{4}-\d\d-\d\d", "(?:ab)?c", "a{,3}", "a{2,}", "x{0}y", "(a*)*b", "(a|ab)(c|bcd)(d*)",
    r"[\w.-]+@\w+\.com", ".*", ".+x", r"\S+\s\W", r"[\d\s]*", r"[^\d\s]+", r"\D\w", "[-a]", "[a-]", "[]a]", "[^]a]", r"[\]\-\\]+",
    "a{", "a{x}", "a}", "]", "^ab$", "a|", "()", "(|a)+", r"\(\)\{\}\[\]\|\*\+\?\^\$\.\/\"", r"\n\t\r", r"\u00e9\u0041", r"\x41+",
    "é[а-я]+ü?", "日本語?", "[^日]", "😀+", "[😀-😂]", "[^a]", r"[^\n]*", "(?:a|b|cd){2,4}e?", "((a|b)c)*", "[a-cx-z0-9]{1,3}",
]
ALPHABET = "abcdexyz0159-_@. \n\t\\\"/(){}[]|*+?^$éüаяж日本語😀😁😂\x00\x7f\u0080"


@pytest.mark.parametrize("pattern", PATTERNS)
def test_dfa_agrees_with_re_on_random_strings(pattern):
    compiled, dfa, rng = re.compile(pattern, re.ASCII), DFA(pattern), random.Random(pattern)
    strings = [""] + ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 8))) for _ in range(1500)]
    for s in strings:
        assert dfa.accepting[dfa.step(dfa.start, s.encode())] == bool(compiled.fullmatch(s)), (pattern, s)


def test_dfa_agrees_with_re_on_matching_strings():
    cases = {r"\d{4}-\d{2}-\d{2}": ["2024-01-31", "2024-1-31", "20240131"], "(?:ab|cd)+e": ["abe", "abcdabe", "e", "abcd"],
             "[^\"\\\\]*": ["plain", "with\"quote", "back\\slash", "ünïcödé 😀"], ".": ["\n", "é", "😀", "ab"]}
    for pattern, strings in cases.items():
        for s in strings: assert matches(pattern, s) == bool(re.fullmatch(pattern, s, re.ASCII)), (pattern, s)


def _atom():
    chars = st.sampled_from(list("abc") + [r"\d", r"\w", r"\s", ".", "[a-c]", "[^a]", r"\.", "é", "日"])
    return chars


def _regexes():
    def extend(inner):
        group = inner.map(lambda r: f"({r})") | inner.map(lambda r: f"(?:{r})")
        cat = st.lists(inner, min_size=2, max_size=3).map("".join)
        alt = st.lists(inner, min_size=2, max_size=3).map("|".join).map(lambda r: f"(?:{r})")
        rep = st.tuples(group | _atom(), st.sampled_from(["*", "+", "?", "{2}", "{1,3}", "{0,2}", "{2,}"])).map("".join)
        return group | cat | alt | rep
    return st.recursive(_atom(), extend, max_leaves=6)


@settings(max_examples=150, deadline=None)
@given(pattern=_regexes(), strings=st.lists(st.text(alphabet="abc0 .é日\n_", max_size=7), min_size=20, max_size=20))
def test_random_regexes_agree_with_re(pattern, strings):
    compiled, dfa = re.compile(pattern, re.ASCII), DFA(pattern)
    for s in strings:
        assert dfa.accepting[dfa.step(dfa.start, s.encode())] == bool(compiled.fullmatch(s)), (pattern, s)


@pytest.mark.parametrize("pattern, message", [
    ("(a", "never closed"), ("a)", "unbalanced parenthesis"), ("*a", "nothing to repeat"), ("a**", "multiple repeat"),
    ("a*?", "lazy"), ("a+?", "lazy"), ("a{1,2}?", "lazy"), (r"(a)\1", "backreferences"), ("(?=a)b", "groups are supported"),
    ("(?<!a)b", "groups are supported"), ("(?P<x>a)", "groups are supported"), ("[b-a]", "bad character range"),
    ("a{3,2}", "below the minimum"), ("a{1001}", "above 1000"), ("a{2,5000}", "above 1000"), ("[ab", "unterminated"),
    ("ab\\", "lone backslash"), (r"\bword", "word boundaries"), ("a^b", "'^'"), ("a$b", "'$'"), (r"[\d-z]", "bad character range"),
    (r"\q", "bad escape"), (r"\u12", "hex digits"), (r"\p{L}", "Unicode properties"), ("(?i)a", "groups are supported"),
])
def test_unsupported_syntax_is_refused_with_its_position(pattern, message):
    with pytest.raises(ValueError, match="position") as e: parse_regex(pattern)
    assert message in str(e.value) and repr(pattern) in str(e.value)


def test_utf8_sequences_cover_each_range_exactly():
    rng = random.Random(0)
    for lo, hi in [(0, 0x10FFFF), (0x80, 0x10000), (0x400, 0x4FF), (0x1F600, 0x1F64F), (0xD000, 0xE100)] + \
                  [tuple(sorted(rng.sample(range(0x110000), 2))) for _ in range(20)]:
        seqs = utf8_sequences(lo, hi)
        assert sum(math.prod(b - a + 1 for a, b in s) for s in seqs) == (hi - lo + 1) - max(0, min(hi, 0xDFFF) - max(lo, 0xD800) + 1)
        for cp in [lo, hi] + [rng.randint(max(0, lo - 50), min(0x10FFFF, hi + 50)) for _ in range(500)]:
            if 0xD800 <= cp <= 0xDFFF: continue
            b = chr(cp).encode()
            hits = sum(len(s) == len(b) and all(a <= x <= c for x, (a, c) in zip(b, s)) for s in seqs)
            assert hits == (lo <= cp <= hi), (lo, hi, cp)


def test_automaton_size_limits():
    with pytest.raises(ValueError, match="states"): NFA("(?:a{1000}){1000}")
    dfa = DFA("(a|b)*a(a|b){12}", max_states=200)  # the 13th byte from the end must be an a: 2^13 states
    rng = random.Random(0)
    with pytest.raises(ValueError, match="more than 200 states"): dfa.step(dfa.start, bytes(rng.choice(b"ab") for _ in range(400)))


def test_a_pattern_that_matches_nothing_is_refused(vocab):
    with pytest.raises(ValueError, match="matches no text"): TokenConstraint(r"a[^\s\S]", vocab, [2])


# ---------------------------------------------------------------- tokens: masks on the default tokenizer

def guided_walk(c: TokenConstraint, vocab, rng: random.Random, max_steps: int = 400, finish_after: int = 40):
    """A random path of allowed tokens to EOS: uniform among the allowed tokens at first, then more and more often the
    single-byte token that starts a shortest way to a match (so that every walk ends). Returns (text bytes, tokens)."""
    state, text, tokens = c.start, b"", []
    single = {b[0]: i for i, b in enumerate(vocab) if b is not None and len(b) == 1}
    for step in range(max_steps):
        mask = c.allowed(state)
        assert mask.dtype == torch.bool and mask.shape == (c.vocab_size,)
        ids = mask.nonzero().flatten().tolist()
        assert ids, f"nothing allowed after {text!r}"  # never empty for a live state on this tokenizer
        if step >= finish_after or rng.random() < 0.2:  # the shortest way to the end
            token = c.eos_token_ids[0] if c.accepts(state) else single[shortest_way(c.dfa, state)]
        elif c.accepts(state) and rng.random() < 0.3:
            token = c.eos_token_ids[0]
        else:
            token = rng.choice(ids)
        assert mask[token], (text, token)
        state = c.advance(state, token)
        tokens.append(token)
        if state == FINAL: return text, tokens
        text += vocab[token]
    raise AssertionError(f"no end after {max_steps} steps: {text!r}")


def shortest_way(dfa, state: int) -> int:
    "The first byte of a shortest byte path from `state` (not accepting) to an accepting state (breadth first)."
    first, todo = {state: None}, [state]
    while todo:
        nxt = []
        for s in todo:
            if dfa.accepting[s]: return first[s]
            row = dfa.rows(np.array([s]))[s]
            for b in range(256):
                t = int(row[b])
                if t != DEAD and t not in first: first[t] = b if first[s] is None else first[s]; nxt.append(t)
        todo = nxt
    raise AssertionError("no way to a match")


WALK_PATTERNS = [r"\d{4}-\d{2}-\d{2}", r"[a-z]+@[a-z]+\.(?:com|org)", "(?:yes|no|maybe)", r"\w+( \w+){0,3}", "[^a]{1,12}", ".{1,20}",
                 "[а-я]{2,6}", "日本語|español|😀+", r'"(?:[^"\\]|\\.)*"', r"(?:\d+,)*\d+"]


@pytest.mark.parametrize("pattern", WALK_PATTERNS)
def test_random_walks_end_in_a_match(pattern, vocab):
    c, rng = TokenConstraint(pattern, vocab, [2]), random.Random(pattern)
    for _ in range(15):
        text, _ = guided_walk(c, vocab, rng)
        decoded = text.decode("utf-8")  # strict: the output is always whole characters
        assert re.fullmatch(pattern, decoded, re.ASCII), (pattern, decoded)


@pytest.mark.parametrize("pattern, prefix", [(r"\d{4}-\d{2}-\d{2}", "20"), (r"[a-z]+@[a-z]+\.(?:com|org)", "ann@ex"),
                                             (r"\w+( \w+){0,3}", "The quick"), ("[^a]{1,12}", "xyz"), (".{0,30}", "héllo"),
                                             ("(?:yes|no|maybe)", ""), ("[а-я]{2,6}", "пр")])
def test_allowed_is_exactly_the_tokens_that_keep_a_valid_prefix(pattern, prefix, tok, vocab):
    c = TokenConstraint(pattern, vocab, [2])
    state = c.dfa.step(c.start, prefix.encode())
    mask, oracle = c.allowed(state), regex.compile(pattern, regex.ASCII)
    rng = random.Random(0)
    sample = rng.sample(range(len(vocab)), 3000) + mask.nonzero().flatten().tolist()[:3000]
    checked = 0
    for t in sample:
        if vocab[t] is None: assert t == 2 or not mask[t]; continue
        try: text = prefix + vocab[t].decode("utf-8")
        except UnicodeDecodeError: continue  # a token ending inside a character: the walks check those
        valid = bool(vocab[t]) and oracle.fullmatch(text, partial=True) is not None
        assert bool(mask[t]) == valid, (pattern, prefix, vocab[t])
        checked += 1
    assert checked > 2000
    assert bool(mask[2]) == bool(re.fullmatch(pattern, prefix, re.ASCII))  # EOS iff the text is a match


def test_tokens_that_end_inside_a_character_are_allowed_where_the_character_may_follow(vocab):
    c = TokenConstraint("[а-я]+", vocab, [2])
    partial = [i for i, b in enumerate(vocab) if b is not None and len(b) == 1 and b[0] == "п".encode()[0]]  # 0xD0
    assert partial and all(c.allowed(c.start)[i] for i in partial)
    mid = c.advance(c.start, partial[0])
    assert not c.accepts(mid) and not c.allowed(mid)[2]  # half a character is no match
    ok = c.allowed(mid)
    assert ok[[i for i, b in enumerate(vocab) if b == "п".encode()[1:]][0]] and not ok[[i for i, b in enumerate(vocab) if b == b"a"][0]]


def test_eos_and_refused_tokens(vocab):
    c = TokenConstraint("ab|abc", vocab, [2, 0])
    a, ab = vocab.index(b"a"), vocab.index(b"ab")
    assert not c.allowed(c.start)[2] and not c.allowed(c.start)[0]
    with pytest.raises(ValueError, match="EOS"): c.advance(c.start, 2)
    with pytest.raises(ValueError, match="cannot continue"): c.advance(c.start, vocab.index(b"b"))
    with pytest.raises(ValueError, match="cannot continue"): c.advance(c.start, 1)  # a special token (None)
    s = c.advance(c.start, ab)
    assert c.accepts(s) and c.allowed(s)[2] and c.allowed(s)[0] and c.allowed(s)[vocab.index(b"c")]
    end = c.advance(s, 0)
    assert end == FINAL and c.accepts(end) and c.allowed(end).nonzero().flatten().tolist() == [0, 2]
    assert c.advance(end, 2) == FINAL
    with pytest.raises(ValueError): c.advance(end, a)
    with pytest.raises(ValueError, match="state"): c.allowed(10_000)
    with pytest.raises(ValueError, match="token_id"): c.advance(c.start, len(vocab))
    with pytest.raises(ValueError, match="eos_token_ids"): TokenConstraint("a", vocab, [])


def test_empty_and_none_tokens_are_never_allowed():
    c = TokenConstraint("a*", [b"a", b"", None, b"aa", b"b", b"<eos>"], [5])
    assert c.allowed(c.start).tolist() == [True, False, False, True, False, True]
    assert c.allowed_bits(c.start) is c.allowed_bits(c.start)  # cached, as bits
    assert c.allowed(c.start).tolist() == np.unpackbits(c.allowed_bits(c.start), count=6, bitorder="little").astype(bool).tolist()


def test_masks_can_be_empty_when_the_vocabulary_lacks_a_byte():
    c = TokenConstraint("ab", [b"a", b"c"], [1])  # no token holds b: documented, the caller decides
    s = c.advance(c.start, 0)
    assert c.allowed(s).sum() == 0 and s != DEAD


# ---------------------------------------------------------------- JSON schemas: an independent validator

def same(a, b) -> bool:
    "JSON equality (True is not 1)."
    if isinstance(a, bool) or isinstance(b, bool): return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)): return a == b
    if isinstance(a, list) and isinstance(b, list): return len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, dict) and isinstance(b, dict): return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def valid(v, s, root) -> bool:
    "Whether JSON value v is valid for schema s (the subset json_schema_regex supports), written from the JSON Schema spec."
    if s is True or s == {}: return True
    if "$ref" in s:
        target = root
        for part in s["$ref"][2:].split("/"): target = target[part]
        return valid(v, target, root)
    if "anyOf" in s: return any(valid(v, b, root) for b in s["anyOf"])
    if "oneOf" in s: return sum(valid(v, b, root) for b in s["oneOf"]) == 1
    if "allOf" in s and not all(valid(v, b, root) for b in s["allOf"]): return False
    if "const" in s and not same(v, s["const"]): return False
    if "enum" in s and not any(same(v, e) for e in s["enum"]): return False
    types = s.get("type")
    if types is not None:
        kinds = {"string": lambda: isinstance(v, str), "null": lambda: v is None, "boolean": lambda: isinstance(v, bool),
                 "integer": lambda: isinstance(v, int) and not isinstance(v, bool) or isinstance(v, float) and v.is_integer(),
                 "number": lambda: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
                 "array": lambda: isinstance(v, list), "object": lambda: isinstance(v, dict)}
        if not any(kinds[t]() for t in ([types] if isinstance(types, str) else types)): return False
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        if v < s.get("minimum", -math.inf) or v > s.get("maximum", math.inf): return False
        if v <= s.get("exclusiveMinimum", -math.inf) or v >= s.get("exclusiveMaximum", math.inf): return False
    if isinstance(v, str):
        if not s.get("minLength", 0) <= len(v) <= s.get("maxLength", math.inf): return False
        if "pattern" in s and not re.search(s["pattern"], v): return False
        checks = {"date": datetime.date.fromisoformat, "time": datetime.time.fromisoformat, "uuid": uuid.UUID,
                  "date-time": datetime.datetime.fromisoformat}
        if "format" in s:
            try: checks[s["format"]](v)
            except ValueError: return False
    if isinstance(v, list):
        if not s.get("minItems", 0) <= len(v) <= s.get("maxItems", math.inf): return False
        if not all(valid(x, s.get("items", True), root) for x in v): return False
    if isinstance(v, dict):
        props = s.get("properties", {})
        if not all(k in v for k in s.get("required", [])): return False
        for k, x in v.items():
            sub = props.get(k, s.get("additionalProperties", True))
            if sub is False or not valid(x, sub, root): return False
    return True


@settings(max_examples=300, deadline=None)
@given(st.integers(-10**16 + 1, 10**16 - 1), st.integers(0, 10**17), st.integers(-10**6, 10**6))
def test_integer_ranges_match_exactly_the_integers_between_their_bounds(lo, width, probe):
    hi = min(lo + width, 10**16 - 1)
    pattern = re.compile(integer_range(lo, hi))
    for x in (lo - 1, lo, lo + 1, hi - 1, hi, hi + 1, probe, lo + probe % (hi - lo + 1), 0, 9, 10, -1, -10):
        assert bool(pattern.fullmatch(str(x))) == (lo <= x <= hi), (lo, hi, x)
    assert not any(pattern.fullmatch(t) for t in ("", "-0", "00", "01", "-01", "+1"))


def test_the_validator_rejects_what_it_should():
    s = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": [1, "x"]}}, "required": ["a"], "additionalProperties": False}
    assert valid({"a": 1}, s, s) and valid({"a": 1, "b": "x"}, s, s)
    assert not valid({"b": 1}, s, s) and not valid({"a": True}, s, s) and not valid({"a": 1, "b": True}, s, s) and not valid({"a": 1, "c": 1}, s, s)
    assert not valid("2023-02-30", {"type": "string", "format": "date"}, {})


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"},
                                           "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"}}, "required": ["name", "age"]}
SCHEMAS = {
    "person": PERSON,
    "optional only": {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "null"}, "c": {"type": "number"}}},
    "enum and const": {"type": "object", "properties": {"kind": {"const": "point"}, "tag": {"enum": [1, "x", None, [1, 2], {"k": "é"}]},
                                                        "flag": {"type": "boolean", "enum": [True, 1]}}, "required": ["kind", "tag"]},
    "array": {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 3}, "minItems": 1, "maxItems": 4},
    "nullable date": {"type": ["string", "null"], "format": "date"},
    "formats": {"type": "object", "properties": {f: {"type": "string", "format": f} for f in ("date", "time", "date-time", "uuid")},
                "required": ["date", "time", "date-time", "uuid"]},
    "refs": {"$defs": {"p": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}, "required": ["x", "y"]}},
             "type": "array", "items": {"$ref": "#/$defs/p"}, "maxItems": 3},
    "definitions": {"definitions": {"c": {"enum": ["red", "green"]}}, "type": "object", "properties": {"color": {"$ref": "#/definitions/c"}},
                    "required": ["color"], "additionalProperties": False},
    "one of": {"oneOf": [{"type": "integer"}, {"type": "string", "pattern": "[a-z]{2,4}"}, {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}]},
    "any of": {"anyOf": [{"type": "number"}, {"type": "integer"}, {"type": "null"}]},
    "any value": {"type": "object", "properties": {"meta": {}, "list": {"type": "array"}}, "required": ["meta", "list"]},
    "free keys": {"type": "object", "additionalProperties": {"type": "integer"}},
    "closed": {"type": "object", "additionalProperties": False},
    "non-ascii": {"type": "object", "properties": {"città": {"type": "string", "pattern": "^[а-я ]{1,8}$"}}, "required": ["città"]},
    "all of one": {"allOf": [{"type": "string", "maxLength": 2}], "title": "short"},
    "bounds": {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 150},
                                                "t": {"type": "integer", "exclusiveMinimum": -40.5, "exclusiveMaximum": 61},
                                                "big": {"type": "integer", "minimum": 123456789012}, "w": {"type": "number", "minimum": 0}},
               "required": ["age", "t", "big", "w"]},
}


@pytest.mark.parametrize("name", SCHEMAS)
def test_random_walks_produce_valid_json(name, vocab):
    schema = SCHEMAS[name]
    c, rng = TokenConstraint(json_schema_regex(schema), vocab, [2]), random.Random(name)
    for _ in range(10):
        text, _ = guided_walk(c, vocab, rng)
        value = json.loads(text.decode("utf-8"))
        assert valid(value, schema, schema), (name, text)


def test_json_is_written_as_json_dumps_writes_it():
    pattern = json_schema_regex(PERSON)
    value = {"name": "Ann", "age": 30, "email": "ann@ex.com"}
    assert re.fullmatch(pattern, json.dumps(value)) and re.fullmatch(pattern, json.dumps({"name": "Ann", "age": -1}))
    assert not re.fullmatch(pattern, json.dumps(value, separators=(",", ":"))) and not re.fullmatch(pattern, json.dumps(value, indent=1))
    assert not re.fullmatch(pattern, json.dumps({"age": 30, "name": "Ann"}))  # properties in the schema's order


def test_json_object_walks_produce_objects(vocab, tok):
    c = compile_structured(StructuredOutputs(json_object=True), tok, [2], tok.vocab_size)
    rng, depths = random.Random(0), []
    def depth(v): return 1 + max(map(depth, v.values() if isinstance(v, dict) else v), default=0) if isinstance(v, (dict, list)) else 0
    for _ in range(15):
        text, _ = guided_walk(c, vocab, rng)
        value = json.loads(text)
        assert isinstance(value, dict) and depth(value) <= JSON_OBJECT_DEPTH
        depths.append(depth(value))
    assert max(depths) >= 1


@pytest.mark.parametrize("schema, message", [
    ({"type": "number", "minimum": 1}, "minimum on a number"), ({"type": "object", "patternProperties": {}}, "'patternProperties'"),
    ({"type": "integer", "minimum": 5, "exclusiveMaximum": 5}, "no integer"), ({"type": "integer", "maximum": "3"}, "maximum='3'"),
    ({"type": "array", "uniqueItems": True}, "'uniqueItems'"), ({"type": "string", "format": "email"}, "format='email'"),
    ({"$ref": "#"}, "recursive"), ({"$defs": {"n": {"type": "array", "items": {"$ref": "#/$defs/n"}}}, "$ref": "#/$defs/n"}, "recursive"),
    ({"$ref": "#/$defs/missing"}, "names nothing"), ({"$ref": "https://example.com/s.json"}, "local"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"), ({"type": "object", "properties": {}, "required": ["a"]}, "'a'"),
    ({"type": "string", "pattern": '"+'}, "escaping"), ({"type": "string", "pattern": "a(b"}, "never closed"),
    ({"type": "string", "pattern": "[a-z]+", "maxLength": 3}, "maxLength with pattern"), ({"type": "date"}, "type='date'"),
    ({"type": "array", "maxItems": 5000}, "maxItems=5000"), ({"type": "string", "minLength": 3, "maxLength": 2}, "below"),
    ({"enum": []}, "non-empty"), ({"type": "integer", "enum": ["a"]}, "of type"), ({"allOf": [{}, {}]}, "allOf"),
    ({"type": "object", "anyOf": [{}]}, "anyOf together with 'type'"), (False, "allows no value"),
])
def test_unsupported_schemas_are_refused(schema, message):
    with pytest.raises(ValueError) as e: json_schema_regex(schema)
    assert message in str(e.value)


# ---------------------------------------------------------------- StructuredOutputs, compile_structured, the model

def test_choice_walks_give_a_choice(tok, vocab):
    choices = ["positive", "negative", "neutral", "très bien", "a|b", ""]
    c = compile_structured(StructuredOutputs(choice=choices), tok, [2], tok.vocab_size)
    seen = {guided_walk(c, vocab, random.Random(seed))[0].decode() for seed in range(40)}
    assert seen <= set(choices) and len(seen) >= 3


@pytest.mark.parametrize("kwargs, message", [
    ({}, "exactly one"), ({"regex": "a", "choice": ["a"]}, "regex='a', choice="), ({"regex": 1}, "regex=1"),
    ({"choice": []}, "choice=[]"), ({"choice": "ab"}, "choice='ab'"), ({"choice": ["a", 2]}, "choice[1]=2"),
    ({"json": "{nope"}, "not valid JSON"), ({"json": [1]}, "json=[1]"), ({"json": {"a": {1, 2}}}, "not JSON"),
    ({"json_object": "yes"}, "json_object='yes'"), ({"regex": "a{5,1}"}, "below the minimum"),
    ({"json": {"type": "number", "maximum": 3}}, "maximum on a number"),
])
def test_structured_outputs_refuse_bad_values(kwargs, message):
    with pytest.raises(ValueError) as e: StructuredOutputs(**kwargs)
    assert message in str(e.value)


def test_structured_outputs_are_hashable_and_canonical():
    a, b = StructuredOutputs(json=PERSON), StructuredOutputs(json=json.dumps(PERSON, indent=2))
    assert a == b and hash(a) == hash(b) and a.schema == PERSON
    assert StructuredOutputs(choice=["x", "y"]) == StructuredOutputs(choice=("x", "y"))
    assert StructuredOutputs(choice=["x", "y"]).choice == ("x", "y")
    assert re.fullmatch(StructuredOutputs(choice=["a.b", "(c)"]).pattern(), "(c)") and not re.fullmatch(StructuredOutputs(choice=["a.b"]).pattern(), "axb")


def test_compile_structured_shares_one_constraint(tok):
    spec = StructuredOutputs(regex=r"\d+")
    c = compile_structured(spec, tok, {2}, tok.vocab_size)
    assert compile_structured(StructuredOutputs(regex=r"\d+"), tok, (2,), tok.vocab_size) is c
    assert compile_structured(spec, tok, (2, 0), tok.vocab_size) is not c
    wide = compile_structured(spec, tok, [2], tok.vocab_size + 64)  # padding rows of the logits: never drawn
    assert wide.allowed(wide.start).shape == (tok.vocab_size + 64,) and not wide.allowed(wide.start)[tok.vocab_size:].any()
    special = sorted(tok.added_ids - {2})
    assert not c.allowed(c.advance(c.start, tok.encode("7")[0]))[special].any()
    with pytest.raises(ValueError, match="StructuredOutputs"): compile_structured({"regex": "a"}, tok, [2], tok.vocab_size)


def test_constraint_state_follows_one_sequence(tok):
    c = compile_structured(StructuredOutputs(choice=["yes", "no"]), tok, [2], tok.vocab_size)
    seq = ConstraintState(c)
    seq.advance(tok.encode("yes")[0])
    assert seq.accepts() and seq.allowed()[2] and not seq.finished
    seq.advance(2)
    assert seq.finished and seq.allowed().sum() == 1


def test_masking_makes_the_default_model_answer_in_json(tok):
    from nanoserve.loader import load_model
    from nanoserve.sampling import greedy_naive
    torch.manual_seed(0)
    model = load_model()
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer"}}, "required": ["name", "age"]}
    prompt = tok.apply_chat_template([{"role": "user", "content": "Alice is 30. Give her name and age."}], tokenize=True)
    c = compile_structured(StructuredOutputs(json=schema), tok, tok.stop_token_ids, model.config.vocab_size)
    out = greedy_structured(model, prompt, c, 30)
    assert out[-1] == 2
    value = json.loads(tok.decode(out[:-1]))
    assert valid(value, schema, schema)
    plain = greedy_naive(model, prompt, len(out))  # unconstrained, the model does not answer in this form
    assert not re.fullmatch(c.pattern, tok.decode(plain))
