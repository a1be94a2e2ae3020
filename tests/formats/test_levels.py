"""Each level type on its own, through the capability interface only."""
import pytest
import torch

from scorch.formats import Compressed, Dense, Fixed, LevelStorage, Singleton
from scorch.formats.levels import LEVEL_TYPES
from scorch.formats.levels.fixed import SlotsExceeded

L = torch.tensor


def test_capabilities_and_properties():
    assert Dense().full and Dense().coord_iter and Dense().locate and Dense().insert and not Dense().pos_iter
    for lvl in (Compressed(), Singleton(), Fixed()):
        assert lvl.pos_iter and lvl.append and not lvl.locate and not lvl.full
    assert Compressed.arrays == ("pos", "crd") and Singleton.arrays == ("crd",) and Fixed.arrays == ("crd",)
    assert Dense.arrays == ()
    assert Fixed().padded and not Fixed().unique and Fixed().ordered
    assert not Compressed(unique=False).unique and Compressed(unique=False).keeps_duplicates
    assert not Fixed().keeps_duplicates  # padding, not duplicates
    assert set(LEVEL_TYPES) == {"dense", "compressed", "singleton", "fixed"}
    assert hash(Compressed()) == hash(Compressed()) and Compressed() != Compressed(unique=False)


def test_dense_iterate_locate_assemble():
    d = Dense()
    src, child, crd = d.iterate(LevelStorage(), L([0, 2]), 3, 0, 3)
    assert src.tolist() == [0, 0, 0, 1, 1, 1]
    assert child.tolist() == [0, 1, 2, 6, 7, 8]
    assert crd.tolist() == [0, 1, 2, 0, 1, 2]
    pos, found = d.locate_pos(LevelStorage(), L([1, 1]), L([2, 5]), 0, 3)
    assert pos.tolist()[0] == 5 and found.tolist() == [True, False]
    st, child, n = d.assemble(L([0, 1]), 2, L([-1, 0]), -2, 1)  # range [-2, 1): offset by lo
    assert child.tolist() == [1, 5] and n == 6 and st.arrays() == {}


def test_compressed_assemble_and_iterate():
    c = Compressed()
    # entries sorted by (parent, coordinate); (1, 4) appears twice and shares a position
    st, child, n = c.assemble(L([0, 0, 1, 1, 3]), 4, L([1, 5, 4, 4, 0]), 0, 6)
    assert st.pos.tolist() == [0, 2, 3, 3, 4] and st.crd.tolist() == [1, 5, 4, 0]
    assert child.tolist() == [0, 1, 2, 2, 3] and n == 4
    src, child, crd = c.iterate(st, L([3, 0]), 4, 0, 6)
    assert src.tolist() == [0, 1, 1] and child.tolist() == [3, 0, 1] and crd.tolist() == [0, 1, 5]
    with pytest.raises(NotImplementedError, match="cannot locate"):
        c.locate_pos(st, L([0]), L([1]), 0, 6)


def test_nonunique_compressed_keeps_every_entry():
    st, child, n = Compressed(unique=False).assemble(L([0, 0, 0]), 1, L([2, 2, 3]), 0, 4)
    assert st.pos.tolist() == [0, 3] and st.crd.tolist() == [2, 2, 3] and child.tolist() == [0, 1, 2]


def test_singleton_one_coordinate_per_parent():
    s = Singleton()
    st, child, n = s.assemble(L([0, 1, 2]), 3, L([7, 1, 4]), 0, 9)
    assert st.crd.tolist() == [7, 1, 4] and child.tolist() == [0, 1, 2] and n == 3
    src, child, crd = s.iterate(st, L([2, 0]), 3, 0, 9)
    assert crd.tolist() == [4, 7] and child.tolist() == [2, 0]
    with pytest.raises(ValueError, match="only one coordinate per parent"):
        s.assemble(L([0, 0]), 1, L([1, 2]), 0, 9)


def test_fixed_pads_with_the_last_coordinate():
    f = Fixed()
    st, child, n = f.assemble(L([0, 0, 0, 2]), 3, L([1, 4, 6, 3]), 0, 9)
    assert st.crd.tolist() == [1, 4, 6, 0, 0, 0, 3, 3, 3]  # width 3; row 1 empty, row 2 padded
    assert child.tolist() == [0, 1, 2, 6] and n == 9
    src, child, crd = f.iterate(st, L([0, 1, 2]), 3, 0, 9)
    assert child.tolist() == list(range(9)) and crd.tolist() == st.crd.tolist()
    st, child, n = f.assemble(L([], dtype=torch.int64), 2, L([], dtype=torch.int64), 0, 5)
    assert n == 0 and st.crd.numel() == 0


def test_fixed_slots_pin_the_width():
    f = Fixed(slots=3)
    assert str(f) == "fixed(3)" and f != Fixed() and f == Fixed(3) and hash(f) == hash(Fixed(3))
    st, child, n = f.assemble(L([0, 0, 2]), 3, L([1, 4, 3]), 0, 9)
    assert st.crd.tolist() == [1, 4, 4, 0, 0, 0, 3, 3, 3]  # width 3, though no parent has more than 2
    assert child.tolist() == [0, 1, 6] and n == 9
    st, child, n = f.assemble(L([], dtype=torch.int64), 2, L([], dtype=torch.int64), 1, 5)
    assert n == 6 and st.crd.tolist() == [1] * 6
    with pytest.raises(SlotsExceeded) as e:  # parent 1 has 3 entries, 2 slots
        Fixed(slots=2).assemble(L([0, 1, 1, 1, 2, 2, 2]), 3, L([0, 1, 2, 3, 0, 1, 2]), 0, 4)
    assert (e.value.entry, e.value.count, e.value.slots) == (1, 3, 2)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="positive integer"):
            Fixed(slots=bad)


@pytest.mark.parametrize("lvl, storage, parents, fragment", [
    (Compressed(), LevelStorage(pos=L([0, 2]), crd=L([0, 1])), 2, "pos has 2 entries, expected 3"),
    (Compressed(), LevelStorage(pos=L([1, 2, 2]), crd=L([0, 1])), 2, r"pos\[0\] = 1"),
    (Compressed(), LevelStorage(pos=L([0, 2, 1]), crd=L([0, 1])), 2, r"pos decreases at pos\[2\]"),
    (Compressed(), LevelStorage(pos=L([0, 1, 3]), crd=L([0, 1])), 2, r"pos\[-1\] = 3 but crd has 2"),
    (Compressed(), LevelStorage(pos=L([0, 1, 2]), crd=L([0, 9])), 2, r"crd\[1\] = 9 is out of range \[0, 4\)"),
    (Compressed(), LevelStorage(pos=L([0, 1, 2]), crd=L([0.0, 1.0])), 2, "crd must be int8, int16, int32 or int64"),
    (Singleton(), LevelStorage(crd=L([0, 1, 2])), 2, "crd has 3 entries, expected 2"),
    (Singleton(), LevelStorage(crd=L([0, -1])), 2, r"crd\[1\] = -1 is out of range"),
    (Fixed(), LevelStorage(crd=L([0, 1, 2])), 2, "not a multiple"),
    (Fixed(slots=2), LevelStorage(crd=L([0, 1])), 2, "crd has 2 entries, expected 2 for each of the 2 parents"),
])
def test_validate_names_the_problem(lvl, storage, parents, fragment):
    with pytest.raises(ValueError, match=fragment):
        lvl.validate(storage, parents, 0, 4, "level 1 (j : test)")
