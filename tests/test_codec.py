"""The codec: items -> (ItemSpec, chunk frames) -> items, bit for bit."""

from __future__ import annotations

import re
import sys
import types
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import torch

from mmcache import BatchedField, FieldElem, FlatField, InvalidArgumentError, MMItem, SharedField
from mmcache._dtypes import ITEMSIZE
from mmcache._equal import nested_equal
from mmcache._frames import chunk_payload_offset, chunk_prefix
from mmcache._spec import item_size
from mmcache.client._codec import (
    EncodedItem,
    copy_payload,
    decode_item,
    encode_item,
    iter_chunk_frames,
    num_chunks,
)
from mmcache.client.colocated._plans import decode_from_region
from mmcache.client.wire import Spec
from mmcache.v1 import cache_pb2 as pb

# 1 byte and 5 bytes split every multi-byte leaf across frames; 64 packs several
# small leaves into one frame; 1 MiB holds a whole test item in one frame.
CHUNK_SIZES = [1, 5, 64, 1 << 20]
DTYPES = sorted(ITEMSIZE)


def random_bits(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A tensor of random bit patterns (NaNs, infinities, -0.0 and all)."""
    gen = torch.Generator().manual_seed(seed)
    numel = 1
    for dim in shape:
        numel *= dim
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def round_trip(item: Mapping[str, Any], chunk_bytes: int) -> Any:
    """encode -> frames -> decode; Any, as each test checks the form it expects."""
    encoded = encode_item(item)
    frames = list(iter_chunk_frames(encoded, chunk_bytes))
    assert len(frames) == num_chunks(encoded, chunk_bytes)
    return decode_item(encoded.spec, frames)


def leaves(data: object) -> Iterator[torch.Tensor]:
    if isinstance(data, torch.Tensor):
        yield data
    elif isinstance(data, list | tuple):
        for child in data:
            yield from leaves(child)


@pytest.mark.parametrize("chunk_bytes", CHUNK_SIZES)
@pytest.mark.parametrize("dtype_name", DTYPES)
def test_every_dtype_and_layout_round_trips_bit_exact(dtype_name: str, chunk_bytes: int) -> None:
    dtype = getattr(torch, dtype_name)
    data: dict[str, Any] = {
        "plain": random_bits(dtype, (5, 7), 1),
        "zero_d": random_bits(dtype, (), 2),
        "empty": random_bits(dtype, (0, 3), 3),
        "transposed": random_bits(dtype, (6, 4), 4).t(),
        "strided": random_bits(dtype, (8, 9), 5)[1::3, ::2],
        "expanded": random_bits(dtype, (3, 1), 6).expand(3, 4),
        "nested": (random_bits(dtype, (3,), 7), [random_bits(dtype, (2, 2), 8), 7, 2.5, True]),
    }
    assert not data["transposed"].is_contiguous()
    assert not data["strided"].is_contiguous()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # complex32 must decode without its "experimental" warning
        out = round_trip(data, chunk_bytes)
    assert type(out) is dict
    assert list(out) == list(data)
    for key, value in data.items():
        assert nested_equal(out[key], value), key
    assert out["transposed"].shape == (4, 6)
    assert out["zero_d"].shape == ()
    for tensor in leaves(list(out.values())):
        assert tensor.is_contiguous()
        assert tensor.dtype == dtype
        assert tensor.untyped_storage().nbytes() == tensor.nbytes  # its own storage


def flat_image_item() -> MMItem:
    pixels = torch.randn(6, 4)
    return MMItem.from_elems(
        [
            FieldElem(
                "image",
                "pixel_values",
                pixels,
                FlatField([slice(0, 2), slice(2, None, None), slice(None, -1, 2)], dim=1),
            ),
            FieldElem(
                "image",
                "patches",
                [torch.arange(4), (torch.ones(2, dtype=torch.bfloat16), -3, 0.5, False)],
                FlatField([(slice(None), slice(0, 3)), (slice(1, 2, None),)], dim=0),
            ),
            FieldElem("image", "image_grid_thw", torch.tensor([1, 4, 6]), BatchedField()),
            FieldElem("image", "num_crops", 3, SharedField(batch_size=5)),
        ]
    )


@pytest.mark.parametrize("chunk_bytes", CHUNK_SIZES)
def test_mm_item_keeps_field_kinds_modality_and_slices(chunk_bytes: int) -> None:
    item = flat_image_item()
    out = round_trip(item, chunk_bytes)
    assert isinstance(out, MMItem)
    assert out == item
    assert list(out) == list(item)
    flat = out["patches"].field
    assert isinstance(flat, FlatField)
    assert flat.slices[0] == (slice(None, None, None), slice(0, 3, None))
    assert flat.slices[1] == (slice(1, 2, None),)
    assert flat.dim == 0
    assert out["pixel_values"].field == FlatField(
        [slice(0, 2), slice(2, None), slice(None, -1, 2)], dim=1
    )
    assert out["num_crops"].data == 3
    assert type(out["num_crops"].data) is int


def test_keep_on_cpu_travels_with_every_field_kind() -> None:
    data = torch.arange(4)
    item = MMItem.from_elems(
        [
            FieldElem("image", "a", data, BatchedField(keep_on_cpu=True)),
            FieldElem("image", "b", data, FlatField([slice(0, 2)], keep_on_cpu=True)),
            FieldElem("image", "c", data, SharedField(batch_size=2, keep_on_cpu=True)),
            FieldElem("image", "d", data, SharedField(batch_size=2)),
        ]
    )
    out = round_trip(item, 1 << 20)
    assert out == item
    assert [e.field.keep_on_cpu for e in out.values()] == [True, True, True, False]  # type: ignore[union-attr]


def test_scalars_come_back_as_python_scalars_of_their_type() -> None:
    data = {"s": [True, 1, -(1 << 63), (1 << 63) - 1, 1.5, -0.0, float("nan"), float("inf"), ()]}
    out = round_trip(data, 7)
    assert [type(v) for v in out["s"]] == [bool, int, int, int, float, float, float, float, tuple]
    assert nested_equal(out["s"], data["s"])  # -0.0 and NaN compare by bits


def test_deep_nesting_keeps_lists_and_tuples_apart() -> None:
    data: object = torch.arange(3)
    for depth in range(30):
        data = [data, depth] if depth % 2 else (data,)
    out = round_trip({"deep": data}, 5)
    assert nested_equal(out["deep"], data)
    assert type(out["deep"]) is list
    assert type(out["deep"][0]) is tuple


def test_size_is_tensor_bytes_plus_getsizeof_of_scalars() -> None:
    item = flat_image_item()
    encoded = encode_item(item)
    tensors = [t for elem in item.values() for t in leaves(elem.data)]
    scalars = sys.getsizeof(-3) + sys.getsizeof(0.5) + sys.getsizeof(False) + sys.getsizeof(3)
    payload = sum(t.nbytes for t in tensors)
    assert encoded.size == item_size(encoded.spec.message)
    assert encoded.size.payload == payload
    assert encoded.size.leaves == len(tensors) == 4
    assert encoded.size.charged == payload + scalars
    assert [t.nbytes for t in encoded.tensors] == [t.nbytes for t in tensors]
    assert all(t.is_contiguous() and t.device.type == "cpu" for t in encoded.tensors)


def test_frames_are_bytes_of_exactly_chunk_bytes_with_a_short_last_one() -> None:
    encoded = encode_item({"a": torch.arange(10, dtype=torch.int8), "b": torch.arange(7.0)})
    assert encoded.size.payload == 10 + 28
    frames = iter_chunk_frames(encoded, 16)
    assert isinstance(frames, types.GeneratorType)  # made lazily, one at a time
    sizes = []
    for frame in frames:
        assert type(frame) is bytes
        offset = chunk_payload_offset(frame)
        assert frame[:offset] == chunk_prefix(len(frame) - offset)
        sizes.append(len(frame) - offset)
    assert sizes == [16, 16, 6]
    assert num_chunks(encoded, 16) == 3
    whole = b"".join(f[chunk_payload_offset(f) :] for f in iter_chunk_frames(encoded, 16))
    assert whole == torch.arange(10, dtype=torch.int8).numpy().tobytes() + bytes(
        torch.arange(7.0).numpy().data
    )


def test_an_item_without_tensor_bytes_has_no_chunks() -> None:
    data: dict[str, Any] = {"n": 4, "e": torch.empty(0, 5), "t": (1.0, [])}
    encoded = encode_item(data)
    assert num_chunks(encoded, 1) == 0
    assert list(iter_chunk_frames(encoded, 1)) == []
    out: Any = decode_item(encoded.spec, [])
    assert nested_equal(list(out.values()), list(data.values()))
    assert encode_item(MMItem()).spec.message.form == pb.ItemSpec.FORM_ITEM
    assert decode_item(encode_item({}).spec, []) == {}


def test_decoded_tensors_are_writable_and_independent_of_the_frames() -> None:
    encoded = encode_item({"a": torch.zeros(4), "b": torch.zeros(4)})
    frames = list(iter_chunk_frames(encoded, 12))  # "b" starts inside a's last frame
    out: Any = decode_item(encoded.spec, frames)
    out["a"] += 1
    assert torch.equal(out["b"], torch.zeros(4))
    again: Any = decode_item(encoded.spec, frames)  # the frames were not written through
    assert torch.equal(again["a"], torch.zeros(4))


def test_encoding_does_not_touch_the_caller_tensor() -> None:
    source = torch.arange(12.0).reshape(3, 4)
    encoded = encode_item({"x": source.t()})
    frames = list(iter_chunk_frames(encoded, 8))
    assert torch.equal(source, torch.arange(12.0).reshape(3, 4))
    out: Any = decode_item(encoded.spec, frames)
    assert torch.equal(out["x"], source.t())


def test_lazy_conjugate_negative_and_grad_tensors_travel_as_their_values() -> None:
    z = torch.complex(torch.randn(5), torch.randn(5))
    w = torch.randn(3, requires_grad=True)
    data = {"conj": z.conj(), "neg": z.conj().imag, "grad": w * 2}
    assert data["conj"].is_conj()
    out = round_trip(data, 5)
    assert torch.equal(out["conj"], z.conj().resolve_conj())
    assert torch.equal(out["neg"], -z.imag)
    assert torch.equal(out["grad"], (w * 2).detach())
    assert not out["grad"].requires_grad


def test_encoded_modality_is_the_items_else_the_argument() -> None:
    same = flat_image_item()
    assert encode_item(same, modality="video").modality == "image"
    mixed = MMItem.from_elems(
        [FieldElem("image", "a", 1, BatchedField()), FieldElem("video", "b", 2, BatchedField())]
    )
    assert encode_item(mixed, modality="video").modality == "video"
    assert encode_item(mixed).modality == ""
    mapping = encode_item({"a": torch.ones(1)}, modality="audio")
    assert mapping.modality == "audio"
    assert mapping.spec.message.form == pb.ItemSpec.FORM_MAPPING
    assert mapping.spec.message.fields[0].modality == ""
    assert mapping.spec.message.fields[0].WhichOneof("field") is None


def test_a_plain_dict_of_field_elems_is_stored_as_an_item() -> None:
    elems = dict(flat_image_item())
    out = round_trip(elems, 64)
    assert isinstance(out, MMItem)
    assert out == MMItem(elems)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ("text", "field 'k' holds a builtins.str"),
        (None, "field 'k' holds a builtins.NoneType"),
        ([torch.ones(1), {"x": 1}], "field 'k' holds a builtins.dict"),
        (1 << 63, "9223372036854775808 does not fit in int64"),
        ([-(1 << 63) - 1], "does not fit in int64"),
        (torch.ones(2).numpy(), "field 'k' holds a numpy.ndarray"),
        (torch.ones(2).to_sparse(), "field 'k' holds a torch.sparse_coo tensor"),
        (torch.empty(2, device="meta"), "field 'k' holds a meta tensor"),
        ("qint8", "holds a tensor of dtype qint8, which mmcache cannot carry"),
    ],
    ids=["str", "none", "dict", "int-big", "int-small", "ndarray", "sparse", "meta", "qint8"],
)
def test_unsupported_data_is_rejected_naming_the_key(data: object, message: str) -> None:
    if isinstance(data, str) and data == "qint8":  # made here: creating it warns "deprecated"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            data = torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)
    with pytest.raises(InvalidArgumentError, match=re.escape(message)):
        encode_item({"k": data})  # type: ignore[dict-item]


def test_nesting_beyond_the_limit_is_rejected() -> None:
    data: object = 1
    for _ in range(40):
        data = [data]
    with pytest.raises(InvalidArgumentError, match="field 'deep' nests deeper than 32 levels"):
        encode_item({"deep": data})  # type: ignore[dict-item]


def test_malformed_items_are_rejected() -> None:
    with pytest.raises(InvalidArgumentError, match="item keys must be str"):
        encode_item({1: torch.ones(1)})  # type: ignore[dict-item]
    with pytest.raises(InvalidArgumentError, match="holds a FieldElem keyed 'b'"):
        encode_item(MMItem({"a": FieldElem("image", "b", 1, BatchedField())}))
    with pytest.raises(InvalidArgumentError, match="must be a FieldElem, got int"):
        encode_item(MMItem({"a": 1}))  # type: ignore[dict-item]
    with pytest.raises(InvalidArgumentError, match="slice stop must be an int, got float"):
        encode_item(MMItem.from_elems([FieldElem("m", "a", 1, FlatField([slice(0, 1.5)]))]))
    with pytest.raises(InvalidArgumentError, match="each entry is a slice or a tuple"):
        encode_item(MMItem.from_elems([FieldElem("m", "a", 1, FlatField([3]))]))  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="field 'a' has field kind str"):
        encode_item(MMItem.from_elems([FieldElem("m", "a", 1, "flat")]))  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="chunk_bytes must be at least 1"):
        num_chunks(encode_item({"a": 1}), 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_are_copied_to_cpu() -> None:
    data = {"x": torch.arange(6.0, device="cuda").reshape(2, 3).t()}
    encoded = encode_item(data)
    assert all(t.device.type == "cpu" for t in encoded.tensors)
    out: Any = decode_item(encoded.spec, list(iter_chunk_frames(encoded, 8)))
    assert out["x"].device.type == "cpu"
    assert torch.equal(out["x"], data["x"].cpu())


def encoded_and_frames() -> tuple[EncodedItem, list[bytes]]:
    encoded = encode_item({"a": torch.arange(10.0), "b": [torch.ones(3, dtype=torch.int16)]})
    return encoded, list(iter_chunk_frames(encoded, 16))


def test_frames_with_too_few_or_too_many_bytes_are_rejected() -> None:
    encoded, frames = encoded_and_frames()
    with pytest.raises(InvalidArgumentError, match="need 46 bytes but its chunk frames carry 32"):
        decode_item(encoded.spec, frames[:-1])
    with pytest.raises(InvalidArgumentError, match="need 46 bytes but its chunk frames carry more"):
        decode_item(encoded.spec, [*frames, chunk_prefix(1) + b"x"])
    short = frames[-1][:-1]
    with pytest.raises(InvalidArgumentError, match="declares 14 bytes but carries 13"):
        decode_item(encoded.spec, [*frames[:-1], short])
    header = pb.UpdateFrame(header=pb.UpdateRequest()).SerializeToString() or b"\x0a\x00"
    with pytest.raises(InvalidArgumentError, match="expected a chunk frame"):
        decode_item(encoded.spec, [header, *frames])


def test_an_invalid_spec_is_rejected_before_reading_frames() -> None:
    encoded, frames = encoded_and_frames()
    spec = pb.ItemSpec()
    spec.CopyFrom(encoded.spec.message)
    spec.fields[0].data.tensor.dtype = "float128"
    with pytest.raises(InvalidArgumentError, match="unknown dtype 'float128'"):
        decode_item(Spec(spec), frames)


def test_nested_equal_is_bit_exact() -> None:
    t = torch.tensor([1.0, float("nan"), -0.0])
    assert nested_equal([t, (1, 2.5, True)], [t.clone(), (1, 2.5, True)])
    assert not nested_equal(t, torch.tensor([1.0, float("nan"), 0.0]))  # -0.0 is not 0.0
    assert not nested_equal(t, t.double())
    assert not nested_equal(t, t.reshape(1, 3))
    assert nested_equal(t.reshape(3, 1).t(), t.reshape(1, 3))  # layout does not matter
    assert not nested_equal([t], (t,))
    assert not nested_equal(True, 1)
    assert not nested_equal(1, 1.0)
    assert not nested_equal([1, 2], [1, 2, 3])
    assert nested_equal(float("nan"), float("nan"))
    assert not nested_equal(0.0, -0.0)
    assert not nested_equal(t, [1.0, float("nan"), -0.0])
    other_nan = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)
    assert not nested_equal(torch.tensor([float("nan")]), other_nan)  # NaN payloads differ


def region_read(item: Mapping[str, Any]) -> Any:
    """encode -> one payload (as a region's extent holds it) -> decode by plan."""
    encoded = encode_item(item)
    payload = bytearray(item_size(encoded.spec.message).payload)
    copy_payload(encoded, memoryview(payload))
    got = decode_from_region(encoded.spec.serialize(), memoryview(payload), None)
    assert got is not None and got[1] == len(payload)
    return got[0]


def same(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Equal items: every field's data bit-exact, and an MMItem's fields and modalities."""
    if list(a) != list(b):
        return False
    if isinstance(a, MMItem):
        return all(
            nested_equal(a[k].data, b[k].data)
            and (a[k].field, a[k].modality) == (b[k].field, b[k].modality)
            for k in a
        )
    return all(nested_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_a_region_read_decodes_by_plan_as_the_frames_do(dtype_name: str) -> None:
    dtype = getattr(torch, dtype_name)
    data = {
        "plain": random_bits(dtype, (5, 7), 1),
        "zero_d": random_bits(dtype, (), 2),
        "nested": (random_bits(dtype, (3,), 7), [random_bits(dtype, (2, 2), 8), 7, 2.5, True]),
    }
    for item in (data, flat_image_item()):
        for _ in range(2):  # the second read by the plan the first made
            out = region_read(item)
            assert type(out) is type(item)
            assert same(out, round_trip(item, 1 << 20))


def test_a_region_read_of_tensor_fields_gives_each_read_its_own_tensors() -> None:
    # Every field one tensor: the item is built from the plan without a walk.
    item = MMItem.from_elems(
        [
            FieldElem("image", "pixel_values", torch.randn(6, 4), FlatField([slice(0, 2)], dim=0)),
            FieldElem("image", "image_grid_thw", torch.tensor([1, 2, 3]), BatchedField()),
        ]
    )
    first, second = region_read(item), region_read(item)
    for out in (first, second):
        assert same(out, item)
    first["pixel_values"].data.zero_()
    assert nested_equal(second["pixel_values"].data, item["pixel_values"].data)
    tensor = second["pixel_values"].data
    assert tensor.untyped_storage().nbytes() == tensor.nbytes  # its own storage


def test_a_region_read_of_a_spec_that_is_not_one_is_none() -> None:
    encoded = encode_item({"x": torch.ones(4)})
    payload = memoryview(bytearray(16))
    assert decode_from_region(b"\xff\xff", payload, None) is None
    assert decode_from_region(encoded.spec.serialize(), payload[:8], None) is None
