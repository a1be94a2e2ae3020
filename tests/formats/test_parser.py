import pickle

import pytest

import scorch
from scorch.formats import Add, Compressed, Dense, Div, Fixed, Format, Mod, Singleton, Sub, Var

REQUIRED = [
    "(i, j) -> (i / 2 : dense, j / 3 : compressed, i % 2 : dense, j % 3 : dense)",
    "(i, j) -> (j - i : compressed, i : dense)",
    "(i, j) -> (j - i : compressed, j : dense)",
    "(i, j) -> (i + j : compressed, i : dense)",
    "(i, j) -> (i + j : compressed, j : dense)",
]


@pytest.mark.parametrize("text", REQUIRED)
def test_required_formats_parse_and_round_trip(text):
    f = Format(text)
    assert str(f) == text
    assert Format(str(f)) == f
    assert hash(Format(str(f))) == hash(f)
    assert pickle.loads(pickle.dumps(f)) == f


def test_bsr_text_is_the_named_bsr():
    f = Format(REQUIRED[0])
    assert f == scorch.formats.bsr(2, 3)
    assert f.name == "bsr(2, 3)"
    assert f.levels == ((Div(0, 2), Dense()), (Div(1, 3), Compressed()), (Mod(0, 2), Dense()), (Mod(1, 3), Dense()))


def test_floor_division_spelling_and_names_do_not_matter():
    a = Format("(row, col) -> (row // 2 : dense, col // 3 : compressed, row % 2 : dense, col % 3 : dense)")
    assert a == Format(REQUIRED[0])
    assert Format("(x,y)->(y-x:compressed,x:dense)") == scorch.formats.dia


def test_expressions_parsed():
    assert Format(REQUIRED[1]).exprs == (Sub(1, 0), Var(0))
    assert Format(REQUIRED[3]).exprs == (Add(0, 1), Var(0))


def test_properties_parse_and_render():
    text = "(i, j) -> (i : compressed(nonunique, nonordered), j : singleton(nonunique))"
    f = Format(text)
    assert f.level_types == (Compressed(unique=False, ordered=False), Singleton(unique=False))
    assert str(f) == text
    assert Format("(i, j) -> (i : compressed(unique, ordered), j : dense)") == Format(
        "(i, j) -> (i : compressed, j : dense)")


def test_formats_are_immutable_and_compare_by_value():
    f = Format("(i, j) -> (i : dense, j : compressed)")
    with pytest.raises(AttributeError):
        f.ndim = 3
    assert f == scorch.formats.csr and f != scorch.formats.csc
    assert len({f, scorch.formats.csr, Format(str(f))}) == 1
    assert f != "csr"


@pytest.mark.parametrize("text, fragment, column", [
    ("(i, j) -> (i : dense, j : compresed)", "unknown level type 'compresed'", 26),
    ("(i, j) -> (i : dense, k : compressed)", "unknown dimension 'k'", 22),
    ("(i, i) -> (i : dense)", "declared twice", 4),
    ("(i, j) -> (i : dense)", "dimension 'j' is not stored by any level", 4),
    ("(i, j) -> (i : dense j : compressed)", "expected ',' or ')'", 21),
    ("(i, j) -> (i / 0 : dense, j : dense)", "positive integer", 15),
    ("(i, j) -> (i / x : dense, j : dense)", "block size", 15),
    ("(i, j) (i : dense, j : dense)", "expected '->'", 7),
    ("(i, j) -> (i : dense, j : compressed(fancy))", "unknown level property 'fancy'", 37),
    ("(i, j) -> (i : dense, j : compressed(2))", "expected a level property, found '2'", 37),
    ("(i, j) -> (i : dense, j : fixed(0))", "one positive number of slots", 32),
    ("(i, j) -> (i : dense, j : fixed(2, 3))", "one positive number of slots", 35),
    ("(i, j) -> (i : dense(nonunique), j : dense)", "cannot be nonunique", 21),
    ("(i, j) -> (i : dense, j : compressed) extra", "unexpected text", 38),
    ("(i, j) -> (i * j : dense)", "unexpected character '*'", 13),
    ("(i, j) -> (i - i : dense, j : dense)", "two different dimensions", 13),
    ("", "empty format", 0),
])
def test_malformed_formats_say_what_and_where(text, fragment, column):
    with pytest.raises(ValueError) as e:
        Format(text)
    msg = str(e.value)
    assert fragment in msg
    assert f"at column {column}" in msg


@pytest.mark.parametrize("text, fragment", [
    ("(i, j) -> (i / 2 : dense, j : compressed)", "i / 2 needs a level i % 2"),
    ("(i, j) -> (i % 2 : dense, j : compressed)", "i % 2 needs a level i / 2"),
    ("(i, j) -> (i / 2 : dense, j : compressed, i % 3 : dense)", "block sizes"),
    ("(i, j) -> (j - i : compressed, i + j : dense)", "needs a level storing one of its dimensions"),
    ("(i, j) -> (i : dense, j : dense, i : compressed)", "repeats an earlier level"),
    ("(i, j) -> (i : singleton, j : dense)", "has no parent"),
])
def test_non_invertible_or_invalid_maps_are_rejected(text, fragment):
    with pytest.raises(ValueError, match="bad format") as e:
        Format(text)
    assert fragment in str(e.value)


def test_from_levels_builds_the_same_format():
    f = Format.from_levels(2, [(Var(0), Dense()), (Var(1), Fixed())])
    assert f == scorch.formats.ell == Format("(i, j) -> (i : dense, j : fixed)")
    with pytest.raises(ValueError, match="dimension j cannot be recovered"):
        Format.from_levels(2, [(Var(0), Dense())])
    with pytest.raises(TypeError):
        Format(42)


NAMED = {
    "dense": "(i, j) -> (i : dense, j : dense)",
    "coo": "(i, j) -> (i : compressed(nonunique), j : singleton)",
    "csr": "(i, j) -> (i : dense, j : compressed)",
    "csc": "(i, j) -> (j : dense, i : compressed)",
    "dcsr": "(i, j) -> (i : compressed, j : compressed)",
    "dcsc": "(i, j) -> (j : compressed, i : compressed)",
    "ell": "(i, j) -> (i : dense, j : fixed)",
    "dia": "(i, j) -> (j - i : compressed, i : dense)",
    "bsr(2, 3)": REQUIRED[0],
    "bsc(4, 2)": "(i, j) -> (j / 2 : dense, i / 4 : compressed, i % 4 : dense, j % 2 : dense)",
    "nm(2, 4)": "(i, j) -> (i : dense, j / 4 : dense, j % 4 : fixed(2))",
    "nm(1, 8)": "(i, j) -> (i : dense, j / 8 : dense, j % 8 : fixed(1))",
}


@pytest.mark.parametrize("name, text", NAMED.items())
def test_named_formats(name, text):
    f = scorch.formats.resolve(name)
    assert f == Format(text)
    assert f.name == name
    assert repr(f) == f"Format({name!r})"
    assert scorch.formats.resolve(name.upper()) == f


def test_named_format_objects():
    F = scorch.formats
    assert F.csr == F.resolve("csr") and F.bsr(2, 3) == F.resolve("bsr(2,3)") and F.bsc(2, 2) == F.resolve("bsc(2)")
    assert F.csf(3) == Format("(i, j, k) -> (i : compressed, j : compressed, k : compressed)")
    assert F.resolve("csf", 3) == F.csf(3) and F.resolve("dense", 3) == F.dense_nd(3)
    assert F.coo_nd(3) == Format("(i, j, k) -> (i : compressed(nonunique), j : singleton(nonunique), k : singleton)")
    assert F.resolve("coo", 1) == Format("(i) -> (i : compressed)")


def test_nm_formats():
    F = scorch.formats
    f = F.resolve("nm(2,4)")
    assert f == F.nm(2, 4) == Format(str(f)) and pickle.loads(pickle.dumps(f)) == f
    assert f.levels == ((Var(0), Dense()), (Div(1, 4), Dense()), (Mod(1, 4), Fixed(slots=2)))
    assert F.named.short_name(f) == "nm(2, 4)" and F.nm(4, 4).name == "nm(4, 4)"
    assert f != F.nm(1, 4) and f.padded
    # a fixed level without slots, or another layout, is no n:m format
    assert Format("(i, j) -> (i : dense, j / 4 : dense, j % 4 : fixed)").name is None
    assert Format("(i, j) -> (i : dense, j / 4 : dense, j % 4 : fixed(5))").name is None
    assert Format("(i, j) -> (j : dense, i / 4 : dense, i % 4 : fixed(2))").name is None
    assert Format("(i, j) -> (i : dense, j : fixed(3))").name is None
    assert str(Format("(i, j) -> (i : dense, j : fixed(3))")) == "(i, j) -> (i : dense, j : fixed(3))"
    with pytest.raises(TypeError, match="integers"):
        F.nm(2.0, 4)


@pytest.mark.parametrize("spec, error, fragment", [
    ("cssr", ValueError, "unknown format 'cssr'"),
    ("bsr", ValueError, "needs a block size"),
    ("bsr(0, 2)", ValueError, "positive"),
    ("csr(2)", ValueError, "takes no arguments"),
    ("bsr(-1, 2)", ValueError, "positive"),
    ("nm", ValueError, "needs n and m"),
    ("nm(2)", ValueError, "needs n and m"),
    ("nm(5, 4)", ValueError, "cannot exceed the group size m"),
    ("nm(0, 4)", ValueError, "positive"),
    ("nm(2, 0)", ValueError, "positive"),
    ("nm(-2, 4)", ValueError, "positive"),
    (3, TypeError, "scorch.Format or a string"),
])
def test_bad_format_specs(spec, error, fragment):
    with pytest.raises(error, match=fragment.replace("(", r"\(")):
        scorch.formats.resolve(spec)


def test_spec_for_the_wrong_ndim():
    with pytest.raises(ValueError, match="is for 2-d tensors, but the tensor is 3-d"):
        scorch.formats.resolve("csr", 3)


def test_level_bounds():
    f = Format(REQUIRED[0])
    assert f.level_bounds((5, 7)) == ((0, 3), (0, 3), (0, 2), (0, 3))
    assert scorch.formats.dia.level_bounds((4, 6)) == ((-3, 6), (0, 4))
    assert Format(REQUIRED[3]).level_bounds((4, 6)) == ((0, 9), (0, 4))
    with pytest.raises(ValueError, match="for 2-d tensors"):
        f.level_bounds((3,))


@pytest.mark.parametrize("name", ["csr", "csc", "coo", "dcsr", "ell", "dia", "bsr(2, 3)", "nm(2, 4)", "dense",
                                  "(i, j) -> (i : compressed(nonunique), j : singleton(nonunique))",
                                  "(i, j, k) -> (k : dense, i : compressed, j : compressed)"])
def test_a_formats_flags_are_its_levels(name):
    """What ops ask of a format (its level types, expressions, padding, kept duplicates, density), made once with
    it, equals what its levels say."""
    fmt = Format(name)
    types = [lvl for _, lvl in fmt.levels]
    sparse = [lvl for lvl in types if not isinstance(lvl, Dense)]
    assert list(fmt.level_types) == types and list(fmt.exprs) == [e for e, _ in fmt.levels]
    assert fmt.padded == any(lvl.padded for lvl in types)
    assert fmt.keeps_duplicates == (bool(sparse) and sparse[-1].keeps_duplicates)
    assert fmt.keeps_duplicates == name.endswith("singleton(nonunique))")  # (the one format here that keeps them)
    assert fmt.is_dense == all(isinstance(lvl, Dense) for lvl in types)
    again = pickle.loads(pickle.dumps(fmt))
    assert again == fmt and (again.padded, again.keeps_duplicates) == (fmt.padded, fmt.keeps_duplicates)
