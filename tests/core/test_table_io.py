"""HostTable.save / HostTable.load: the file format (xferlib/table/io_format.py), what a save
refuses and how it fails (xferlib/table/io.py), and the format-1 ``.npz`` files still read."""

import errno
import json
import os
import stat
import struct
import tracemalloc
import zipfile
import zlib

import numpy as np
import pytest

import xferlib
from xferlib.table import io as table_io
from xferlib.table import io_format
from xferlib.table.layout import split_state

# Every optimizer, with the options that add state arrays (row scalars, extra slots).
OPTIMIZERS = [
    ("sgd", {"lr": 0.1, "momentum": 0.9}),
    ("adam", {"lr": 0.01, "amsgrad": True}),
    ("adamw", {"lr": 0.01, "weight_decay": 0.1}),
    ("adagrad", {"lr": 0.1}),
    ("rowwise_adagrad", {"lr": 0.1}),
    ("adamax", {"lr": 0.01}),
    ("rmsprop", {"lr": 0.01, "centered": True, "momentum": 0.5}),
    ("adadelta", {}),
]


def _trained(num_rows=37, dim=5, optimizer="adam", kwargs=None, dtype="float32", steps=4,
             **table_kwargs):
    table = xferlib.HostTable(num_rows, dim, dtype=dtype, optimizer=optimizer,
                              optimizer_kwargs=kwargs, seed=3, **table_kwargs)
    rng = np.random.default_rng(7)
    for _ in range(steps if num_rows else 0):
        idx = rng.integers(0, num_rows, 11)
        table.apply_gradients(idx, rng.standard_normal((11, dim)).astype(dtype))
    return table


def _assert_same(loaded, table):
    assert (loaded.num_rows, loaded.dim, loaded.dtype) == (table.num_rows, table.dim,
                                                           table.dtype)
    assert loaded.optimizer == table.optimizer and loaded.hyper == table.hyper
    assert (loaded.cache_rows, loaded.cache_policy, loaded.cache_admission) == (
        table.cache_rows, table.cache_policy, table.cache_admission)
    np.testing.assert_array_equal(loaded.numpy(), table.numpy())
    assert loaded.state_names() == table.state_names()
    for name in table.state_names():
        np.testing.assert_array_equal(loaded.state(name), table.state(name), err_msg=name)


def _no_temporary_files(folder):
    return not [p.name for p in folder.iterdir() if p.name.startswith(".xferlib-")]


# ------------------------------------------------------------------ round trips


@pytest.mark.parametrize("optimizer, kwargs", OPTIMIZERS, ids=[o for o, _ in OPTIMIZERS])
def test_round_trip_of_weights_every_state_array_and_config(tmp_path, optimizer, kwargs):
    table = _trained(optimizer=optimizer, kwargs=kwargs, cache_policy="lfu",
                     cache_admission="always")
    table.save(tmp_path / "t.xft")
    loaded = xferlib.HostTable.load(tmp_path / "t.xft")
    _assert_same(loaded, table)
    # Training goes on identically from the loaded copy.
    idx, grads = np.array([1, 2, 2, 36]), np.full((4, 5), 0.25, np.float32)
    table.apply_gradients(idx, grads)
    loaded.apply_gradients(idx, grads)
    _assert_same(loaded, table)


@pytest.mark.parametrize("num_rows, dim, dtype", [(0, 3, "float32"), (1, 1, "float64"),
                                                  (101, 7, "float32"), (64, 3, "float64")])
def test_round_trip_in_many_pieces(tmp_path, monkeypatch, num_rows, dim, dtype):
    # Pieces of a few rows: arrays cross pieces, and odd sizes pad to 64 bytes.
    monkeypatch.setattr(io_format, "CHUNK_BYTES", 3 * dim * np.dtype(dtype).itemsize + 1)
    table = _trained(num_rows, dim, "rowwise_adagrad", dtype=dtype)
    table.save(tmp_path / "t")
    _assert_same(xferlib.HostTable.load(tmp_path / "t"), table)


def test_file_layout(tmp_path):
    table = _trained(10, 3, "adam")
    path = tmp_path / "t.npz"  # the name is kept as given; the content is not a zip
    table.save(path)
    data = path.read_bytes()
    assert not zipfile.is_zipfile(path)
    magic, version, length, crc = struct.unpack("<8sIII", data[:20])
    assert (magic, version) == (io_format.MAGIC, 2)
    header = data[20:20 + length]
    assert (20 + length) % 64 == 0 and crc == zlib.crc32(header)
    meta = json.loads(header)
    assert meta["format"] == "xferlib.HostTable" and meta["version"] == 2
    assert meta["config"] == json.loads(json.dumps(table_io.table_config(table)))
    assert [a["name"] for a in meta["arrays"]] == ["weights", "exp_avg", "exp_avg_sq", "step"]
    assert len(data) == 20 + length + meta["data_bytes"]
    start = 20 + length
    for spec in meta["arrays"]:  # raw C-ordered arrays at 64-byte offsets
        assert spec["offset"] % 64 == 0
        raw = data[start + spec["offset"]:start + spec["offset"] + spec["nbytes"]]
        array = np.frombuffer(raw, spec["dtype"]).reshape(spec["shape"])
        expected = table.numpy() if spec["name"] == "weights" else table.state(spec["name"])
        np.testing.assert_array_equal(array, expected)


# ------------------------------------------------------------------ refused files


def _saved(tmp_path, name="t.xft"):
    table = _trained(50, 6, "adam")
    path = tmp_path / name
    table.save(path)
    return path, path.read_bytes()


@pytest.mark.parametrize("keep", [0, 5, 20, 100, -1000, -1],
                         ids=["empty", "in-magic", "in-header", "header-cut", "in-data",
                              "last-byte"])
def test_truncated_file_is_refused_naming_it(tmp_path, keep):
    path, data = _saved(tmp_path)
    cut = tmp_path / "cut.xft"
    cut.write_bytes(data[:keep] if keep >= 0 else data[:len(data) + keep])
    with pytest.raises(ValueError, match="truncated") as info:
        xferlib.HostTable.load(cut)
    assert str(cut) in str(info.value)


def test_longer_file_is_refused(tmp_path):
    path, data = _saved(tmp_path)
    path.write_bytes(data + b"\0")
    with pytest.raises(ValueError, match="1 bytes too long"):
        xferlib.HostTable.load(path)


def _data_start(data):
    return 20 + struct.unpack("<I", data[12:16])[0]


@pytest.mark.parametrize("array", ["weights", "exp_avg", "exp_avg_sq", "step"])
def test_flipped_byte_in_an_array_is_refused_naming_file_and_array(tmp_path, array):
    path, data = _saved(tmp_path)
    meta = json.loads(data[20:_data_start(data)])
    spec = next(s for s in meta["arrays"] if s["name"] == array)
    at = _data_start(data) + spec["offset"] + spec["nbytes"] // 2
    path.write_bytes(data[:at] + bytes([data[at] ^ 0x10]) + data[at + 1:])
    with pytest.raises(ValueError, match="corrupt") as info:
        xferlib.HostTable.load(path)
    assert str(path) in str(info.value) and repr(array) in str(info.value)


@pytest.mark.parametrize("where", ["header", "padding", "version", "magic"])
def test_flipped_byte_outside_the_arrays_is_refused(tmp_path, where):
    path, data = _saved(tmp_path)
    meta = json.loads(data[20:_data_start(data)])
    weights = meta["arrays"][0]
    at = {"header": 40, "version": 8, "magic": 1,
          "padding": _data_start(data) + weights["nbytes"] + 1}[where]
    assert where != "padding" or weights["nbytes"] % 64 != 0
    path.write_bytes(data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1:])
    with pytest.raises(ValueError) as info:
        xferlib.HostTable.load(path)
    message = str(info.value)
    assert str(path) in message
    assert {"header": "header's CRC-32", "padding": "padding", "version": "version 3",
            "magic": "not an xferlib HostTable file"}[where] in message


def test_mismatched_arrays_are_refused_naming_the_difference(tmp_path):
    # A configuration and arrays that disagree (a writer's bug): the load names the array.
    table, other = _trained(8, 4, "adam"), _trained(8, 3, "adam")
    path = tmp_path / "t.xft"
    arrays = {"weights": other.numpy(), **{n: other.state(n) for n in other.state_names()}}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        io_format.write_table_file(fd, table_io.table_config(table), arrays)
    finally:
        os.close(fd)
    with pytest.raises(ValueError, match="does not match") as info:
        xferlib.HostTable.load(path)
    assert str(path) in str(info.value) and "'weights'" in str(info.value)
    assert "shape=[8, 3]" in str(info.value) and "shape=[8, 4]" in str(info.value)


def _written(path, config, arrays):
    """A file of ``config`` and ``arrays`` through the format's own writer (CRC-32s valid)."""
    xferlib.atomic_write(path, lambda f: io_format.write_table_file(f.fileno(), config, arrays))


def _arrays_of(table):
    return {"weights": table.numpy(), **{n: table.state(n) for n in table.state_names()}}


@pytest.mark.parametrize("change, reason", [
    (dict(new_option=1), "unexpected keyword argument 'new_option'"),  # a newer xferlib's
    (dict(optimizer="nesterov"), "unknown optimizer 'nesterov'"),
    (dict(dtype="int8"), "float32 or float64"),
])
def test_a_configuration_the_table_refuses_is_refused_naming_the_file(tmp_path, change,
                                                                      reason):
    table = _trained(8, 4, "adam")
    path = tmp_path / "t.xft"
    _written(path, {**table_io.table_config(table), **change}, _arrays_of(table))
    with pytest.raises(ValueError, match=reason) as info:
        xferlib.HostTable.load(path)
    assert f"cannot load a table from {path}" in str(info.value)


@pytest.mark.parametrize("entry", [5, "weights", {"name": "weights"}])
def test_header_array_entry_without_its_crc_is_refused_as_corrupt(tmp_path, entry):
    # A header whose own CRC-32 holds but whose array list is not the format's (a writer's
    # bug): ValueError naming the file, not an AttributeError or KeyError from inside.
    path, data = _saved(tmp_path)
    meta = json.loads(data[20:_data_start(data)])
    meta["arrays"][0] = entry
    header = json.dumps(meta).encode()
    header += b" " * (_data_start(data) - 20 - len(header))
    assert 20 + len(header) == _data_start(data)
    path.write_bytes(data[:12] + struct.pack("<II", len(header), zlib.crc32(header)) + header
                     + data[_data_start(data):])
    with pytest.raises(ValueError, match=f"{path} is corrupt: its header"):
        xferlib.HostTable.load(path)


@pytest.mark.parametrize("hyper", [dict(lr=np.float32(0.25)), dict(lr=np.int64(1))])
def test_numpy_scalar_hyperparameters_round_trip(tmp_path, hyper):
    # A schedule's lr computed in NumPy trains as a float; the save must take it too.
    table = _trained(8, 4, "adam")
    table.set_hyper(**hyper)
    table.save(tmp_path / "t.xft")
    _assert_same(xferlib.HostTable.load(tmp_path / "t.xft"), table)


def test_load_of_missing_file_and_directory(tmp_path):
    with pytest.raises(FileNotFoundError):
        xferlib.HostTable.load(tmp_path / "missing.xft")
    with pytest.raises(IsADirectoryError, match=str(tmp_path)):
        xferlib.HostTable.load(tmp_path)


# ------------------------------------------------------------------ format 1 (.npz)


def _save_format_1(table, path, padded=True):
    """What ``HostTable.save`` wrote before format 2: np.savez of meta, weights and the state
    block as it sat in RAM (the storage row after the weights, padding included; or
    ``state_width`` wide for a table made from an init array, ``padded=False``)."""
    layout = table.layout
    width = layout.row_width - layout.state_offset if padded else layout.state_width
    state = np.zeros((table.num_rows, width), table.dtype)
    slots, scalars, steps = split_state(layout, state)
    for name, view in {**slots, **scalars, "step": steps}.items():
        view[...] = table.state(name)
    meta = dict(format="xferlib.HostTable/1", num_rows=table.num_rows, dim=table.dim,
                dtype=table.dtype.name, optimizer=table.optimizer, hyper=table.hyper,
                cache_rows=table.cache_rows, cache_policy=table.cache_policy,
                cache_admission=table.cache_admission, slots=list(layout.slots),
                row_scalars=list(layout.row_scalars))
    with open(path, "wb") as f:
        np.savez(f, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8),
                 weights=table.numpy(), state=state)


@pytest.mark.parametrize("optimizer, kwargs", OPTIMIZERS, ids=[o for o, _ in OPTIMIZERS])
@pytest.mark.parametrize("dim, padded", [(5, True), (128, True), (128, False)])
def test_format_1_npz_files_still_load(tmp_path, monkeypatch, optimizer, kwargs, dim, padded):
    monkeypatch.setattr(io_format, "CHUNK_BYTES", 4000)  # the members stream in pieces too
    table = _trained(dim=dim, optimizer=optimizer, kwargs=kwargs)
    _save_format_1(table, tmp_path / "old.npz", padded)
    assert table_io.FORMAT == "xferlib.HostTable/1"
    _assert_same(xferlib.HostTable.load(tmp_path / "old.npz"), table)


def test_format_1_npz_truncated_or_corrupt_is_refused(tmp_path):
    table = _trained(40, 8, "sgd")
    _save_format_1(table, tmp_path / "old.npz")
    data = (tmp_path / "old.npz").read_bytes()
    (tmp_path / "cut.npz").write_bytes(data[:len(data) // 2])
    with pytest.raises(ValueError, match="truncated or not an xferlib HostTable file"):
        xferlib.HostTable.load(tmp_path / "cut.npz")
    weights_at = data.index(table.numpy().tobytes()[:32])  # a byte inside the weights member
    (tmp_path / "flip.npz").write_bytes(data[:weights_at] + bytes([data[weights_at] ^ 1])
                                        + data[weights_at + 1:])
    with pytest.raises(ValueError, match="CRC-32") as info:
        xferlib.HostTable.load(tmp_path / "flip.npz")
    assert str(tmp_path / "flip.npz") in str(info.value)


# ------------------------------------------------------------------ targets a save refuses


def test_save_refuses_a_fifo_and_leaves_it(tmp_path):
    table, fifo = _trained(), tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="FIFO, not a regular file") as info:
        table.save(fifo)
    assert str(fifo) in str(info.value)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and _no_temporary_files(tmp_path)


def test_save_refuses_a_directory_naming_it(tmp_path):
    table, folder = _trained(), tmp_path / "folder"
    folder.mkdir()
    with pytest.raises(IsADirectoryError) as info:
        table.save(folder)
    assert str(folder) in str(info.value) and ".xferlib-" not in str(info.value)
    assert folder.is_dir() and not list(folder.iterdir()) and _no_temporary_files(tmp_path)


def test_save_refuses_a_character_device_and_leaves_it(tmp_path):
    node = tmp_path / "null"
    try:  # a /dev/null twin in tmp_path: never a real /dev node
        os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except (PermissionError, OSError) as err:
        pytest.skip(f"cannot make a character device here (needs root): {err}")
    with pytest.raises(ValueError, match="character device") as info:
        _trained().save(node)
    assert str(node) in str(info.value)
    assert stat.S_ISCHR(os.lstat(node).st_mode) and _no_temporary_files(tmp_path)


def test_save_through_a_symlink_writes_its_target(tmp_path):
    table = _trained()
    (tmp_path / "real.xft").write_bytes(b"old")
    (tmp_path / "link.xft").symlink_to("real.xft")
    table.save(tmp_path / "link.xft")
    assert (tmp_path / "link.xft").is_symlink()
    _assert_same(xferlib.HostTable.load(tmp_path / "real.xft"), table)
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "to-fifo").symlink_to("fifo")
    with pytest.raises(ValueError, match="FIFO"):
        table.save(tmp_path / "to-fifo")


# ------------------------------------------------------------------ permissions, failures


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_saved_file_has_the_mode_open_would_give(tmp_path, umask, mode):
    table = _trained()
    old = os.umask(umask)
    try:
        table.save(tmp_path / "t.xft")
        with open(tmp_path / "plain", "w"):
            pass
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "plain").st_mode) == mode
    assert stat.S_IMODE(os.stat(tmp_path / "t.xft").st_mode) == mode


def test_saving_over_a_file_keeps_its_mode(tmp_path):
    path = tmp_path / "t.xft"
    path.write_bytes(b"old")
    os.chmod(path, 0o640)
    _trained().save(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640


@pytest.mark.parametrize("writes_before_full", [0, 1, 3])
def test_full_disk_names_the_path_and_leaves_the_old_file(tmp_path, monkeypatch,
                                                          writes_before_full):
    monkeypatch.setattr(io_format, "CHUNK_BYTES", 256)  # several writes
    path, before = _saved(tmp_path)
    real_write, calls = os.write, []

    def full(fd, data):
        if fd in (1, 2):
            return real_write(fd, data)
        calls.append(len(data))
        if len(calls) > writes_before_full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(OSError) as info:
        _trained(50, 6, "sgd").save(path)
    monkeypatch.undo()
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(path)
    assert str(path) in str(info.value) and "No space left" in str(info.value)
    assert path.read_bytes() == before and _no_temporary_files(tmp_path)


def test_missing_directory_names_path_and_directory(tmp_path):
    target = tmp_path / "no-such-dir" / "t.xft"
    with pytest.raises(FileNotFoundError) as info:
        _trained().save(target)
    assert str(target) in str(info.value) and str(target.parent) in str(info.value)


def test_file_then_directory_synced_around_the_rename(tmp_path, monkeypatch):
    events, real_fsync, real_replace = [], os.fsync, os.replace

    def fsync(fd):
        events.append("fsync " + ("directory" if stat.S_ISDIR(os.fstat(fd).st_mode)
                                  else "file"))
        real_fsync(fd)

    def replace(src, dst):
        events.append("rename")
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    _trained().save(tmp_path / "t.xft")
    # the file synced (before its pages are dropped, and again by atomic_write: a clean
    # file's second sync is free), then renamed, then the directory synced
    assert events[-2:] == ["rename", "fsync directory"] and events[:-2]
    assert set(events[:-2]) == {"fsync file"}


# ------------------------------------------------------------------ memory


def test_memory_holds_the_table_and_small_buffers(tmp_path, monkeypatch):
    # numpy reports its allocations to tracemalloc: a load that read whole arrays before
    # filling the table (format 1's way) would peak at twice the table.
    monkeypatch.setattr(io_format, "CHUNK_BYTES", 1 << 20)
    table = _trained(200_000, 16, "adam", steps=1)
    path = tmp_path / "t.xft"
    tracemalloc.start()
    try:
        table.save(path)
        saving = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        loaded = xferlib.HostTable.load(path)
        after, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    table_bytes = os.path.getsize(path)  # weights and state: 40 MB
    assert table_bytes > 40e6
    assert saving < 4 << 20, saving  # two 1 MiB buffers, no copy of an array
    assert after - before > 0.9 * table_bytes  # the new table, traced (the test sees numpy)
    assert peak - after < 4 << 20, peak - after  # above the table: the two buffers
    _assert_same(loaded, table)


def test_a_collection_file_is_refused_by_name(tmp_path):
    from xferlib.collection import EmbeddingCollection, TableConfig

    path = tmp_path / "coll.bin"
    EmbeddingCollection([TableConfig(5, 4)], "sgd", device="cpu").save(path)
    with pytest.raises(ValueError, match=r"holds a xferlib.EmbeddingCollection, not a HostTable"):
        xferlib.HostTable.load(path)
