"""Malformed list files, hand-picked and generated: each one either loads or
raises ValueError/OSError naming the file (and, for its content, the line);
no other exception type escapes, and a failed convert() patches nothing.

Counts of what is tried are in docs/reliability.md.
"""

import os
import pydoc
import random
import re
import tempfile
from pathlib import Path

import pytest
import torch
from helpers import assert_same, snapshot
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import hmp
from hmp.binding import list_files
from hmp.binding.resolve import Resolver

KINDS = ("bf16_file_path", "fp32_file_path", "promote_file_path")
LINE = re.compile(r"line (\d+)")


def outcome(path, kind="bf16_file_path"):
    """convert() with one user file: None when it loaded, else the error.
    Checks the contract every time: only ValueError/OSError, naming the file,
    and a failed convert() leaves every namespace entry identical."""
    before = snapshot()
    was_converted, lists_before = hmp.is_converted(), hmp.effective_lists()
    try:
        hmp.convert(**{kind: path})
    except (ValueError, OSError) as e:
        assert str(path) in str(e) or repr(str(path)) in str(e), f"error does not name the file: {e}"
        assert_same(before, snapshot())
        assert hmp.is_converted() == was_converted and hmp.effective_lists() == lists_before
        return e
    except Exception as e:  # pragma: no cover - the failure this file hunts for
        raise AssertionError(f"{type(e).__name__} escaped for {path}: {e}") from e
    return None


def content_error(path, kind="bf16_file_path"):
    e = outcome(path, kind)
    assert isinstance(e, ValueError), e
    assert LINE.search(str(e)), f"error does not name a line: {e}"
    return e


def first_line(e):
    return int(LINE.search(str(e)).group(1))


# -- hand-picked ----------------------------------------------------------------------------

LOOK_ALIKES = [
    "lin\u0435ar",  # Cyrillic e
    "\u217cinear",  # small roman numeral fifty
    "\uff4cinear",  # fullwidth l
    "lin\u200bear",  # zero-width space
    "line\u0251r",  # latin alpha
    "re\u029flu",  # small capital L
    "s\u03bfftmax",  # Greek omicron
    "m\u043c",  # Cyrillic em
    "linear\u0301",  # combining accent
    "\u2060linear",  # word joiner
]


@pytest.mark.parametrize("name", LOOK_ALIKES)
def test_unicode_look_alikes_are_rejected_with_their_line(tmp_path, name):
    path = tmp_path / "b.txt"
    path.write_text(f"linear\n{name}\nmm\n", encoding="utf-8")
    e = content_error(path)
    assert first_line(e) == 2 and "not an op name" in str(e)


BAD_CONTENT = {
    "latin-1 bytes": (b"linear\nm\xe9m\n", 2),
    "utf-16 file": ("linear\nmm\n".encode("utf-16"), 1),
    "lone continuation byte": (b"mm\n\x80\n", 2),
    "truncated utf-8": (b"mm\nrelu\n\xe2\x82", 3),
    "NUL inside a name": (b"linear\nlin\x00ear\n", 2),
    "NUL after a name": (b"linear\x00\n", 1),
    "only NULs": (b"\x00" * 64, 1),
    "BOM in the middle": (b"linear\n\xef\xbb\xbfmm\n", 2),
    "two BOMs": (b"\xef\xbb\xbf\xef\xbb\xbflinear\n", 1),
    "dotted name": (b"mm\ntorch.linear\n", 2),
    "call syntax": (b"linear()\n", 1),
    "old Mac line ends": (b"linear\rmm\r", 1),
    "form feed and vertical tab inside": (b"lin\x0cear\n", 1),
    "unknown op": (b"linear\nlinaer\n", 2),
    "keyword": (b"import\n", 1),
    "shell line": (b"#!/bin/sh\nrm -rf /\n", 2),
    "json": (b'["linear", "mm"]\n', 1),
    "very long name": (b"mm\n" + b"a" * 1_000_000 + b"\n", 2),
    "very long garbage line": (b"mm\n" + b"x=" * 500_000 + b"\n", 2),
}


@pytest.mark.parametrize("case", sorted(BAD_CONTENT))
def test_bad_content_names_file_and_line(tmp_path, case):
    data, line = BAD_CONTENT[case]
    path = tmp_path / "list.txt"
    path.write_bytes(data)
    for kind in KINDS:
        e = content_error(path, kind)
        assert first_line(e) == line, str(e)
        assert len(str(e)) < 5000  # a huge line is shortened in the message


GOOD_CONTENT = {
    "empty file": (b"", []),
    "only comments and blanks": (b"# nothing\n\n   \n\t# more\n", []),
    "BOM": (b"\xef\xbb\xbflinear\nmm\n", ["linear", "mm"]),
    "BOM only": (b"\xef\xbb\xbf", []),
    "CRLF": (b"linear\r\nmm\r\n", ["linear", "mm"]),
    "no final newline": (b"linear\nmm", ["linear", "mm"]),
    "duplicates": (b"mm\nlinear\nmm\n  mm  \nmm # again\n" * 1000, ["linear", "mm"]),
    "unicode in comments": (
        "linear # \u043b\u0438\u043d\u0435\u0439\u043d\u044b\u0439 \U0001f600\n".encode(),
        ["linear"],
    ),
    "non-UTF-8 never reached: NUL and junk after #": (b"mm # \x00\xff\n", None),
    "NBSP around a name (whitespace)": ("\u00a0linear\u00a0\n".encode(), ["linear"]),
    "very long comment": (b"mm #" + b"c" * 1_000_000 + b"\n", ["mm"]),
    "very long whitespace": (b" " * 1_000_000 + b"mm\n", ["mm"]),
}


@pytest.mark.parametrize("case", sorted(GOOD_CONTENT))
def test_tolerated_content_loads(tmp_path, case):
    data, names = GOOD_CONTENT[case]
    path = tmp_path / "list.txt"
    path.write_bytes(data)
    e = outcome(path)
    if names is None:  # bytes after '#' on a line that is not UTF-8: the line is rejected, by line
        assert isinstance(e, ValueError) and first_line(e) == 1
        return
    assert e is None, e
    assert hmp.effective_lists()["bf16"] == sorted(names)
    hmp.revert()


@pytest.fixture
def suggestions(monkeypatch):
    """Counts the close-match searches hmp makes ("did you mean"): each costs
    milliseconds, so a file's load is bounded by how many it makes. Work done,
    not wall-clock time, which a busy machine stretches."""
    import difflib

    calls = []
    real = difflib.get_close_matches

    def counted(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(difflib, "get_close_matches", counted)
    return calls


def test_100k_lines_load_with_one_lookup_per_distinct_name(tmp_path, monkeypatch, suggestions):
    path = tmp_path / "big.txt"
    names = ["linear", "mm", "relu", "conv2d", "bmm"]
    path.write_text("".join(f"{names[i % 5]}  # line {i}\n" for i in range(100_000)))
    small = tmp_path / "small.txt"
    small.write_text("".join(f"{n}\n" for n in names))
    lookups = count_lookups(monkeypatch)
    assert outcome(small) is None
    per_name = len(lookups)
    hmp.revert()
    lookups.clear()
    assert outcome(path) is None
    assert hmp.effective_lists()["bf16"] == sorted(names)
    # torch is searched for each distinct name once, however many lines repeat it
    assert suggestions == []
    assert 0 < len(lookups) == per_name, f"{len(lookups)} attribute lookups against {per_name} for five lines"


def count_lookups(monkeypatch):
    """Counts the resolver's searches of torch's namespaces (getattr_static)."""
    calls = []
    real = Resolver._lookup

    def counted(self, namespace, attr, in_class):
        calls.append(attr)
        return real(self, namespace, attr, in_class)

    monkeypatch.setattr(Resolver, "_lookup", counted)
    return calls


def test_100k_unknown_names_fail_with_a_bounded_message_and_bounded_work(tmp_path, monkeypatch, suggestions):
    path = tmp_path / "big.txt"
    path.write_text("".join(f"not_an_op_{i}\n" for i in range(100_000)))
    lookups = count_lookups(monkeypatch)
    e = content_error(path)
    # a set lookup per unknown name, no search of torch's namespaces (Resolver._may_exist)
    assert len(lookups) <= 1000, f"{len(lookups)} attribute lookups"
    # before the fix: a close-match search per name, about 6 minutes
    assert len(suggestions) <= 10, f"{len(suggestions)} close-match searches"
    assert first_line(e) == 1 and "and 99990 more" in str(e) and len(str(e)) < 3000


def test_100k_bad_lines_fail_with_bounded_work(tmp_path, suggestions):
    path = tmp_path / "big.txt"
    path.write_bytes(b"".join(b"not a name %d\n" % i if i % 2 else b"\xff\xfe\n" for i in range(100_000)))
    e = content_error(path)
    assert len(suggestions) <= 10, f"{len(suggestions)} close-match searches"
    assert first_line(e) == 1 and "more" in str(e)


# -- paths that cannot be read -------------------------------------------------------------


def test_directory(tmp_path):
    assert isinstance(outcome(tmp_path), IsADirectoryError)


def test_missing_file_and_missing_parent(tmp_path):
    assert isinstance(outcome(tmp_path / "nope.txt"), FileNotFoundError)
    assert isinstance(outcome(tmp_path / "no" / "such" / "dir.txt"), FileNotFoundError)


def test_path_through_a_file(tmp_path):
    f = tmp_path / "file.txt"
    f.write_text("mm\n")
    assert isinstance(outcome(f / "child.txt"), NotADirectoryError)


def test_dangling_symlink_and_symlink_loop(tmp_path):
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "gone")
    assert isinstance(outcome(dangling), FileNotFoundError)
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    assert isinstance(outcome(loop), OSError)


def test_endless_file_is_a_bounded_read_and_a_valueerror():
    """/dev/zero would be read until memory runs out (MemoryError)."""
    if not Path("/dev/zero").exists():
        pytest.skip("no /dev/zero")
    e = outcome(Path("/dev/zero"))  # the bound is the 64 MiB read; a hang is pytest-timeout's
    assert isinstance(e, ValueError) and "larger than 64 MiB" in str(e)


def test_a_pipe_is_read(tmp_path):
    """Process substitution (``<(echo linear)``) hands hmp a pipe: it works."""
    read_end, write_end = os.pipe()
    os.write(write_end, b"linear\nmm\n")
    os.close(write_end)
    try:
        assert outcome(f"/dev/fd/{read_end}") is None
        assert hmp.effective_lists()["bf16"] == ["linear", "mm"]
    finally:
        os.close(read_end)


def test_name_too_long(tmp_path):
    assert isinstance(outcome(tmp_path / ("x" * 5000)), OSError)


def test_nul_byte_in_path_is_a_valueerror_naming_it(tmp_path):
    path = str(tmp_path / "a\x00b.txt")
    e = outcome(path)
    assert isinstance(e, ValueError) and "null" in str(e)


def test_unreadable_file_as_an_unprivileged_user(tmp_path):
    """Root reads chmod-000 files, so a forked child drops to nobody first."""
    if not hasattr(os, "fork") or os.geteuid() != 0:
        pytest.skip("needs root and fork() to drop privileges in a child")
    path = tmp_path / "secret.txt"
    path.write_text("linear\n")
    path.chmod(0)
    tmp_path.chmod(0o755)
    # hmp reads its shipped lists at every convert: under a directory only root may enter (root's home,
    # mktemp -d) the child cannot reach them, and the test would see that refusal, not the file's
    shipped = list_files.list_dir()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        code = 1
        try:
            os.setgid(65534)
            os.setuid(65534)
            before = snapshot()
            if not os.access(shipped, os.R_OK | os.X_OK):
                msg = f"out of reach|{shipped}".encode()
            else:
                try:
                    hmp.convert(bf16_file_path=path)
                    msg = b"loaded"
                except Exception as e:
                    same = snapshot() == before
                    msg = f"{type(e).__name__}|{same}|{e}".encode()
            os.write(write_end, msg)
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as r:
        msg = r.read().decode()
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, msg
    if msg.startswith("out of reach|"):
        pytest.skip(f"hmp's own files ({msg.split('|', 1)[1]}) are out of an unprivileged user's reach here")
    kind, same, text = msg.split("|", 2)
    assert kind == "PermissionError" and same == "True" and str(path) in text


# -- generated ------------------------------------------------------------------------------

_DIR = Path(tempfile.mkdtemp(prefix="hmp-fuzz-"))
_RESOLVER = Resolver()
# an op, an aten op.overload, or a module class's import path: dotted ASCII identifiers
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def _aten(name):
    try:
        packet = getattr(torch.ops.aten, name)
    except Exception:
        return None
    return packet if isinstance(packet, torch._ops.OpOverloadPacket) else None


def _known(name):
    """A Python-level op name, an aten operator, or an aten operator and
    one of its overloads (straight from torch.ops.aten)."""
    base, dot, overload = name.partition(".")
    if dot and "." not in overload and _aten(base) is not None:
        return overload in _aten(base).overloads()
    if dot:  # anything else dotted names a module class
        found = pydoc.locate(name)
        return isinstance(found, type) and issubclass(found, torch.nn.Module)
    return _RESOLVER.exists(name) or (not name.startswith("__") and _aten(name) is not None)


# an op whose result aliases an input (a view), straight from its schemas;
# the seed's `t` stays allowed (Habana's published lists name it)
def _view(name):
    packet = _aten(name)
    return (
        packet is not None
        and name != "t"
        and any(
            r.alias_info is not None and not r.alias_info.is_write
            for o in packet.overloads()
            for r in getattr(packet, o)._schema.returns
        )
    )


_NOT_PRECISION = {"clone", "__setitem__", "__getitem__", "copy_", "fill_", "zero_", "float", "half"}


def _refused(name):
    """Names a list may not hold (docs/lists.md): views, copies, writes."""
    base = name.partition(".")[0]
    return (
        "." not in name
        and _RESOLVER.exists(name)
        and (name in _NOT_PRECISION or _view(name))
        or (base != name and _aten(base) is not None and _view(base))
    )


def _op_of(name):
    base, dot, rest = name.partition(".")
    return base if dot and "." not in rest and _aten(base) is not None else name


def _expected_bad_lines(data):
    """An oracle for the lines that must be reported, from the documented
    format: a line is a name, '-name' or 'include <shipped list or default>';
    every bad line is reported, in line order: text that is no such line, an
    unknown name, a refused one, and a '-name' whose op the file also lists."""
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    bad, listed, removals = [], set(), []
    shipped = {p.stem for p in hmp.binding.list_files.list_dir().glob("*.txt")} | {"default"}
    for number, raw in enumerate(data.split(b"\n"), start=1):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            bad.append(number)
            continue
        line = text.split("#", 1)[0].strip()
        if not line:
            continue
        words = line.split()
        if len(words) == 2 and words[0] == "include" and _NAME.fullmatch(words[1]):
            if words[1] not in shipped:
                bad.append(number)
            continue
        remove = line.startswith("-")
        name = line[1:].strip() if remove else line
        if not _NAME.fullmatch(name) or not _known(name) or (not remove and _refused(name)):
            bad.append(number)
        elif remove:
            removals.append((number, _op_of(name)))
        else:
            listed.add(_op_of(name))
    bad += [n for n, op in removals if op in listed]
    return sorted(bad)


def _check(data, kind):
    path = _DIR / f"fuzz-{random.getrandbits(64):016x}.txt"
    path.write_bytes(data)
    try:
        bad = _expected_bad_lines(data)
        e = outcome(path, kind)
        event("loads" if e is None else type(e).__name__)
        if bad:
            assert isinstance(e, ValueError), f"expected lines {bad[:5]} to be rejected"
            assert first_line(e) == bad[0], str(e)
        else:
            assert e is None, e
    finally:
        path.unlink()


FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(data=st.binary(max_size=400), kind=st.sampled_from(KINDS))
def test_random_bytes(data, kind):
    _check(data, kind)


NAMES = [
    "linear",
    "mm",
    "relu",
    "softmax",
    "add",
    "mul",
    "conv2d",
    "layer_norm",
    "cat",
    "where",
    "_native_multi_head_attention",
    "relu_",
    "t",
    "linaer",
    "not_an_op",
    "Linear",
    "MM",
    "linear2",
    "cross_entropy_loss",
    "linalg_multi_dot",
    "pow.Tensor_Scalar",
    "_convolution.deprecated",
    "pow.Foo",
    "torch.linear",
    "slice",
    "embedding_bag_sum_fwd",
    "clone",
    "view",
    "__setitem__",
    "copy_",
    "transpose",
    "-linear",
    "-mm",
    "- relu",
    "-linaer",
    "include default",
    "include bf16",
    "include nothing",
    "include",
]
_piece = st.one_of(
    st.sampled_from(NAMES),
    st.sampled_from(LOOK_ALIKES),
    st.sampled_from(["", " ", "\t", "#", "# comment", "\r", "\x00", "\ufeff", "\u00a0", "\u200b", "()", ".", "-"]),
    st.text(max_size=12),
)
_line = st.lists(_piece, max_size=4).map("".join)
_encoded = st.tuples(
    st.lists(_line, max_size=30),
    st.sampled_from(["\n", "\r\n"]),
    st.sampled_from(["utf-8", "utf-8-sig", "latin-1", "utf-16"]),
)


def _encode(lines, sep, encoding):
    text = sep.join(lines)
    try:
        return text.encode(encoding)
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogatepass") if encoding != "utf-16" else text.encode("utf-16", "surrogatepass")


@FUZZ
@given(parts=_encoded, kind=st.sampled_from(KINDS))
def test_generated_list_files(parts, kind):
    _check(_encode(*parts), kind)


@settings(deadline=None)
@given(parts=_encoded)
def test_failed_convert_keeps_the_previous_conversion_identical(parts):
    hmp.convert(opt_level="O1")
    _check(_encode(*parts), "fp32_file_path")
    hmp.revert()
