"""HLO parsing and GEMM classification of benchmarks/gpu_compile.py.

Runs on canned optimized-HLO text (no CUDA plugin needed): the snippets
below have the shape of XLA:GPU output for the patterns the tool reports.
"""

import dataclasses
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] /
                       "benchmarks"))
import gpu_compile as gc  # noqa: E402

# Per-tensor FP8 on the cuBLAS path: the b payload is transposed (an extra
# FP8 pass), the GEMM gets a real a-scale and a constant-1 b-scale, writes
# FP32, and a convert fusion finishes the output.
CUBLAS_F8 = """
HloModule jit_step, is_scheduled=true

%fused_quant (p0: bf16[256,512], p1: f32[]) -> f8e4m3fn[256,512] {
  %p0 = bf16[256,512]{1,0} parameter(0)
  %p1 = f32[] parameter(1)
  %c = f32[256,512]{1,0} convert(%p0)
  %b = f32[256,512]{1,0} broadcast(%p1), dimensions={}
  %m = f32[256,512]{1,0} multiply(%c, %b)
  ROOT %q = f8e4m3fn[256,512]{1,0} convert(%m)
}

%fused_transpose (p0.1: f8e4m3fn[512,128]) -> f8e4m3fn[128,512] {
  %p0.1 = f8e4m3fn[512,128]{1,0} parameter(0)
  ROOT %t = f8e4m3fn[128,512]{1,0} transpose(%p0.1), dimensions={1,0}
}

%fused_convert (p0.2: f32[256,128], p1.2: f32[]) -> bf16[256,128] {
  %p0.2 = f32[256,128]{1,0} parameter(0)
  %p1.2 = f32[] parameter(1)
  %b.2 = f32[256,128]{1,0} broadcast(%p1.2), dimensions={}
  %m.2 = f32[256,128]{1,0} multiply(%p0.2, %b.2)
  ROOT %r.2 = bf16[256,128]{1,0} convert(%m.2)
}

ENTRY %main.1 (x.1: bf16[256,512], w.1: f8e4m3fn[512,128], sa.1: f32[], sb.1: f32[]) -> bf16[256,128] {
  %x.1 = bf16[256,512]{1,0} parameter(0), metadata={op_name="x"}
  %w.1 = f8e4m3fn[512,128]{1,0} parameter(1), metadata={op_name="w"}
  %sa.1 = f32[] parameter(2), metadata={op_name="sa"}
  %sb.1 = f32[] parameter(3), metadata={op_name="sb"}
  %constant_1 = f32[] constant(1)
  %loop_convert_fusion = f8e4m3fn[256,512]{1,0} fusion(%x.1, %sa.1), kind=kLoop, calls=%fused_quant
  %input_transpose_fusion = f8e4m3fn[128,512]{1,0} fusion(%w.1), kind=kInput, calls=%fused_transpose
  %bitcast.3 = f8e4m3fn[512,128]{0,1} bitcast(%input_transpose_fusion)
  %cublas-gemm.1 = (f32[256,128]{1,0}, s8[4194304]{0}) custom-call(%loop_convert_fusion, %bitcast.3, %sa.1, %constant_1), custom_call_target="__cublas$lt$matmul$f8", metadata={op_name="jit(step)/jvp()/dot_general"}, backend_config={"gemm_backend_config":{"alpha_real":1,"beta":0,"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]},"precision_config":{"operand_precision":["DEFAULT","DEFAULT"],"algorithm":"ALG_UNSET"}}}
  %get-tuple-element.1 = f32[256,128]{1,0} get-tuple-element(%cublas-gemm.1), index=0
  ROOT %loop_convert_fusion.1 = bf16[256,128]{1,0} fusion(%get-tuple-element.1, %sb.1), kind=kLoop, calls=%fused_convert
}
"""

# A Triton GEMM fusion that reads FP8 payloads and applies both scalar
# scales and the BF16 convert in its epilogue.
TRITON_F8 = """
HloModule jit_step, is_scheduled=true

%gemm_fusion_dot.1_computation (parameter_0: f8e4m3fn[256,512], parameter_1: f8e5m2[512,128], parameter_2: f32[], parameter_3: f32[]) -> bf16[256,128] {
  %parameter_0 = f8e4m3fn[256,512]{1,0} parameter(0)
  %parameter_1 = f8e5m2[512,128]{1,0} parameter(1)
  %dot.0 = f32[256,128]{1,0} dot(%parameter_0, %parameter_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %parameter_2 = f32[] parameter(2)
  %parameter_3 = f32[] parameter(3)
  %mul.0 = f32[] multiply(%parameter_2, %parameter_3)
  %b.0 = f32[256,128]{1,0} broadcast(%mul.0), dimensions={}
  %mul.1 = f32[256,128]{1,0} multiply(%dot.0, %b.0)
  ROOT %cv.0 = bf16[256,128]{1,0} convert(%mul.1)
}

ENTRY %main.2 (a.1: f8e4m3fn[256,512], b.1: f8e5m2[512,128], sa.1: f32[], sb.1: f32[]) -> bf16[256,128] {
  %a.1 = f8e4m3fn[256,512]{1,0} parameter(0)
  %b.1 = f8e5m2[512,128]{1,0} parameter(1)
  %sa.1 = f32[] parameter(2)
  %sb.1 = f32[] parameter(3)
  ROOT %gemm_fusion_dot.1 = bf16[256,128]{1,0} fusion(%a.1, %b.1, %sa.1, /*index=3*/%sb.1), kind=kCustom, calls=%gemm_fusion_dot.1_computation, metadata={op_name="jit(step)/jvp()/dot_general"}, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
}
"""

# MXFP8 as Triton scaled-dot (E8M0 scale operands), and as cuDNN.
TRITON_SCALED = """
HloModule jit_step, is_scheduled=true

%fusion_scaled-dot (parameter_0: f8e4m3fn[256,512], parameter_1: f8e4m3fn[512,128], parameter_2: f8e8m0fnu[256,16], parameter_3: f8e8m0fnu[16,128]) -> bf16[256,128] {
  %parameter_0 = f8e4m3fn[256,512]{1,0} parameter(0)
  %parameter_1 = f8e4m3fn[512,128]{1,0} parameter(1)
  %parameter_2 = f8e8m0fnu[256,16]{1,0} parameter(2)
  %parameter_3 = f8e8m0fnu[16,128]{1,0} parameter(3)
  %scaled-dot.3 = f32[256,128]{1,0} scaled-dot(%parameter_0, %parameter_1, %parameter_2, %parameter_3), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %convert.34 = bf16[256,128]{1,0} convert(%scaled-dot.3)
}

ENTRY %main.3 (a.1: f8e4m3fn[256,512], b.1: f8e4m3fn[512,128], sa.1: f8e8m0fnu[256,16], sb.1: f8e8m0fnu[16,128]) -> bf16[256,128] {
  %a.1 = f8e4m3fn[256,512]{1,0} parameter(0)
  %b.1 = f8e4m3fn[512,128]{1,0} parameter(1)
  %sa.1 = f8e8m0fnu[256,16]{1,0} parameter(2)
  %sb.1 = f8e8m0fnu[16,128]{1,0} parameter(3)
  ROOT %fusion = bf16[256,128]{1,0} fusion(%a.1, %b.1, %sa.1, %sb.1), kind=kCustom, calls=%fusion_scaled-dot, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
}
"""

CUDNN_MX = """
HloModule jit_step, is_scheduled=true

ENTRY %main.4 (a.1: f8e4m3fn[256,512], b.1: f8e4m3fn[128,512], sa.1: f8e8m0fnu[256,16], sb.1: f8e8m0fnu[128,16]) -> bf16[256,128] {
  %a.1 = f8e4m3fn[256,512]{1,0} parameter(0)
  %b.1 = f8e4m3fn[128,512]{1,0} parameter(1)
  %sa.1 = f8e8m0fnu[256,16]{1,0} parameter(2)
  %sb.1 = f8e8m0fnu[128,16]{1,0} parameter(3)
  %cudnn.1 = (bf16[256,128]{1,0}, u8[0]{0}) custom-call(%a.1, %b.1, %sa.1, %sb.1), custom_call_target="__cudnn$blockScaledDot"
  ROOT %gte.1 = bf16[256,128]{1,0} get-tuple-element(%cudnn.1), index=0
}
"""

# A split-K Triton Wgrad: the contraction (512 tokens) split in 4 batches,
# reduced and scaled by a loop fusion afterwards.
SPLIT_K = """
HloModule jit_step, is_scheduled=true

%gemm_fusion_dot.2_computation (parameter_0.1: f8e4m3fn[4,128,256], parameter_1.1: f8e5m2[4,128,128]) -> f32[4,256,128] {
  %parameter_0.1 = f8e4m3fn[4,128,256]{2,1,0} parameter(0)
  %parameter_1.1 = f8e5m2[4,128,128]{2,1,0} parameter(1)
  ROOT %dot.1 = f32[4,256,128]{2,1,0} dot(%parameter_0.1, %parameter_1.1), lhs_batch_dims={0}, lhs_contracting_dims={1}, rhs_batch_dims={0}, rhs_contracting_dims={1}
}

%fused_multiply (param_0.29: f32[4,256,128], param_1.5: f32[]) -> f32[256,128] {
  %param_0.29 = f32[4,256,128]{2,1,0} parameter(0)
  %param_1.5 = f32[] parameter(1)
  %c0 = f32[] constant(0)
  %r = f32[256,128]{1,0} reduce(%param_0.29, %c0), dimensions={0}, to_apply=%add
  %bb = f32[256,128]{1,0} broadcast(%param_1.5), dimensions={}
  ROOT %m = f32[256,128]{1,0} multiply(%r, %bb)
}

ENTRY %main.5 (x.1: f8e4m3fn[512,256], g.1: f8e5m2[512,128], s.1: f32[]) -> f32[256,128] {
  %x.1 = f8e4m3fn[512,256]{1,0} parameter(0)
  %g.1 = f8e5m2[512,128]{1,0} parameter(1)
  %s.1 = f32[] parameter(2)
  %bitcast.10 = f8e4m3fn[4,128,256]{2,1,0} bitcast(%x.1)
  %bitcast.9 = f8e5m2[4,128,128]{2,1,0} bitcast(%g.1)
  %gemm_fusion_dot.2 = f32[4,256,128]{2,1,0} fusion(%bitcast.10, %bitcast.9), kind=kCustom, calls=%gemm_fusion_dot.2_computation, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  ROOT %loop_multiply_fusion = f32[256,128]{1,0} fusion(%gemm_fusion_dot.2, %s.1), kind=kLoop, calls=%fused_multiply
}
"""


# qlayers' blockwise FFI GEMM on the cuBLASLt path: TN payloads, FP32 scale
# grids as operands, BF16 written by the kernel itself.
FFI_BLOCKWISE = """
HloModule jit_step, is_scheduled=true

ENTRY %main.6 (a.1: f8e4m3fn[256,512], sa.1: f32[256,4], b.1: f8e4m3fn[128,512], sb.1: f32[1,4]) -> bf16[256,128] {
  %a.1 = f8e4m3fn[256,512]{1,0} parameter(0)
  %sa.1 = f32[256,4]{1,0} parameter(1)
  %b.1 = f8e4m3fn[128,512]{1,0} parameter(2)
  %sb.1 = f32[1,4]{1,0} parameter(3)
  ROOT %custom-call.1 = bf16[256,128]{1,0} custom-call(%a.1, %sa.1, %b.1, %sb.1), custom_call_target="qlayers_gemm_blockwise", api_version=API_VERSION_TYPED_FFI, metadata={op_name="jit(step)/ffi_call"}, backend_config={a_rows_per_scale = 1 : i64, b_rows_per_scale = 128 : i64}
}
"""


def only_gemm(text):
  gemms = gc.find_gemms(gc.parse_module(text))
  assert len(gemms) == 1
  return gemms[0]


def test_parse_shape_reads_tuples_and_scalars():
  arrays = gc.parse_shape("(f32[256,128]{1,0}, s8[4194304]{0})")
  assert arrays == (gc.Array("f32", (256, 128)), gc.Array("s8", (4194304,)))
  assert gc.parse_shape("f32[]")[0].size == 1
  assert gc.Array("f4e2m1fn", (64,)).nbytes == 32


def test_parse_instruction_operands_attrs_and_comments():
  inst = gc.parse_instruction(
      '  ROOT %f.1 = bf16[8]{0} fusion(%a, %b, /*index=2*/%c), kind=kCustom, '
      'calls=%comp.1, metadata={op_name="jit(f)/q/dot"}')
  assert inst.root and inst.opcode == "fusion"
  assert inst.operands == ("a", "b", "c")
  assert inst.attr("calls") == "%comp.1"
  assert inst.attr("kind") == "kCustom"
  assert inst.op_name == "jit(f)/q/dot"
  const = gc.parse_instruction("  %constant_1 = f32[] constant(1)")
  assert const.literal == "1" and const.operands == ()
  assert gc.parse_instruction("HloModule jit_f") is None


def test_parse_module_finds_entry_and_parameters():
  comps = gc.parse_module(CUBLAS_F8)
  top = gc.entry(comps)
  assert top.name == "main.1"
  assert top.params == ["x.1", "w.1", "sa.1", "sb.1"]
  assert comps["fused_quant"].root.name == "q"


def test_cublas_fp8_one_scale_folded_and_extra_passes():
  comp, g = only_gemm(CUBLAS_F8)
  assert g.kernel == "cuBLASLt FP8"
  assert (g.a, g.b, g.out) == ("f8e4m3fn", "f8e4m3fn", "f32")
  assert g.dims == {"batch": 1, "m": 256, "n": 128, "k": 512}
  assert g.scales == "a:f32[] b:const 1"
  assert g.folded is False
  pre = gc.pre_passes(comp, g)
  # The FP8 transpose is extra; the quantize (BF16 in) is not.
  assert [p.name for p in pre] == ["input_transpose_fusion"]
  assert pre[0].nbytes == 2 * 512 * 128
  post = gc.post_passes(comp, g)
  assert [p.name for p in post] == ["loop_convert_fusion.1"]
  assert post[0].nbytes == 256 * 128 * (4 + 2) + 4


def test_triton_fp8_epilogue_folds_scales_and_writes_bf16():
  comp, g = only_gemm(TRITON_F8)
  assert g.kernel == "Triton" and g.op == "dot"
  assert (g.a, g.b, g.out) == ("f8e4m3fn", "f8e5m2", "bf16")
  assert g.folded is True
  assert g.epilogue == ("multiply", "convert")
  assert g.operands == ("a.1", "b.1")  # scalar scales are not data
  assert gc.pre_passes(comp, g) == [] and gc.post_passes(comp, g) == []


def test_triton_in_kernel_dequantize_is_shown_as_conversion():
  text = TRITON_F8.replace(
      "%dot.0 = f32[256,128]{1,0} dot(%parameter_0, %parameter_1)",
      "%cv.a = bf16[256,512]{1,0} convert(%parameter_0)\n"
      "  %dot.0 = f32[256,128]{1,0} dot(%cv.a, %parameter_1)")
  _, g = only_gemm(text)
  assert g.a == "f8e4m3fn->bf16" and g.b == "f8e5m2"


def test_scaled_dot_and_cudnn_block_scaled():
  _, g = only_gemm(TRITON_SCALED)
  assert g.kernel == "Triton" and g.op == "scaled-dot"
  assert g.folded is True and g.out == "bf16"
  assert g.dims["k"] == 512
  _, c = only_gemm(CUDNN_MX)
  assert c.kernel == "cuDNN block-scaled"
  assert (c.a, c.b, c.out) == ("f8e4m3fn", "f8e4m3fn", "bf16")
  assert c.dims == {"batch": 1, "m": 256, "n": 128, "k": 512}
  assert c.folded is True


def test_qlayers_ffi_gemm_is_a_native_fp8_kernel_with_its_scales():
  comp, g = only_gemm(FFI_BLOCKWISE)
  assert g.kernel == "qlayers FFI FP8 blockwise"
  assert (g.a, g.b, g.out) == ("f8e4m3fn", "f8e4m3fn", "bf16")
  assert g.dims == {"batch": 1, "m": 256, "n": 128, "k": 512}
  assert g.folded is True and g.operands == ("a.1", "b.1")
  assert gc.gemm_peak(g, gc.TARGETS["h200"]) == (1979.0, "fp8")
  assert gc.pre_passes(comp, g) == [] and gc.post_passes(comp, g) == []
  rec = gc.describe(gc.parse_module(FFI_BLOCKWISE),
                    [gc.LayerDims("dense", 256, 512, 128)], True)[0]
  assert rec["role"] == "dense Fprop" and gc.issues(rec) == []


def test_split_k_wgrad_attribution_and_reduce_pass():
  comp, g = only_gemm(SPLIT_K)
  assert g.dims == {"batch": 4, "m": 256, "n": 128, "k": 128}
  layer = [gc.LayerDims("dense", 512, 256, 128)]
  assert gc.attribute(g, layer, backward=True) == "dense Wgrad"
  post = gc.post_passes(comp, g)
  assert [p.name for p in post] == ["loop_multiply_fusion"]
  # A batched cuBLAS GEMM is not taken for a split-K Wgrad.
  cublas = gc.Gemm(**{**g.__dict__, "kernel": "cuBLASLt"})
  assert gc.attribute(cublas, layer, backward=True) == "other"


def _gemm(m, n, k, batch=1, op_name=""):
  return gc.Gemm("g", "cuBLASLt FP8", "dot", "f8e4m3fn", "f8e4m3fn", "f32",
                 {"batch": batch, "m": m, "n": n, "k": k}, "", None, (),
                 (), op_name=op_name)


def test_attribute_square_layer_uses_direction_and_weight_cone():
  ly = [gc.LayerDims("dense", 64, 64, 64, weight_param="kernel")]
  g = _gemm(64, 64, 64)
  assert gc.attribute(g, ly, backward=False) == "dense Fprop"
  assert gc.attribute(g, ly, backward=True,
                      uses_weight={"st_kernel_value.1", "ct.1"}) == \
      "dense Dgrad"
  assert gc.attribute(g, ly, backward=True, uses_weight={"ct.1", "x.1"}) \
      == "dense Wgrad"
  assert gc.attribute(g, ly, backward=True) == "dense Dgrad | dense Wgrad"


def test_attribute_merged_and_attention():
  layers = [gc.LayerDims(n, 512, 256, 256, shares_input="norm")
            for n in ("q", "k", "v")]
  layers.append(gc.LayerDims("o", 512, 256, 256))
  assert gc.attribute(_gemm(512, 768, 256), layers, backward=False) == \
      "q+k+v Fprop"
  assert gc.attribute(_gemm(256, 768, 512), layers, backward=True) == \
      "q+k+v Wgrad"
  assert gc.attribute(_gemm(512, 256, 256), layers, backward=False) == \
      "q/k/v/o Fprop"
  att = _gemm(128, 128, 64, batch=16, op_name="jit(s)/jvp(attention)/dot")
  assert gc.attribute(att, layers, backward=False) == "attention"
  assert gc.attribute(_gemm(7, 9, 11), layers, backward=None) == "other"


# jax keeps `jax.nn.scaled_matmul` as a called computation: the cuDNN GEMM
# of a square layer's Dgrad (cotangent x weight) sits behind a `call`.
CALLED_CUDNN = """
HloModule jit_step, is_scheduled=true

%scaled_matmul.1 (lhs.0: f8e5m2[1,256,256], rhs.0: f8e4m3fn[1,256,256], ls.0: f8e8m0fnu[1,256,8], rs.0: f8e8m0fnu[1,256,8]) -> bf16[1,256,256] {
  %lhs.0 = f8e5m2[1,256,256]{2,1,0} parameter(0)
  %rhs.0 = f8e4m3fn[1,256,256]{2,1,0} parameter(1)
  %ls.0 = f8e8m0fnu[1,256,8]{2,1,0} parameter(2)
  %rs.0 = f8e8m0fnu[1,256,8]{2,1,0} parameter(3)
  %cc.0 = (bf16[1,256,256]{2,1,0}, u8[0]{0}) custom-call(%lhs.0, %rhs.0, %ls.0, %rs.0), custom_call_target="__cudnn$blockScaledDot"
  ROOT %r.0 = bf16[1,256,256]{2,1,0} get-tuple-element(%cc.0), index=0
}

ENTRY %main.5 (ct.1: f8e5m2[1,256,256], kernel.1: f8e4m3fn[1,256,256], s1.1: f8e8m0fnu[1,256,8], s2.1: f8e8m0fnu[1,256,8]) -> bf16[1,256,256] {
  %ct.1 = f8e5m2[1,256,256]{2,1,0} parameter(0), metadata={op_name="ct"}
  %kernel.1 = f8e4m3fn[1,256,256]{2,1,0} parameter(1), metadata={op_name="st['kernel'].value"}
  %s1.1 = f8e8m0fnu[1,256,8]{2,1,0} parameter(2)
  %s2.1 = f8e8m0fnu[1,256,8]{2,1,0} parameter(3)
  ROOT %call.1 = bf16[1,256,256]{2,1,0} call(%ct.1, %kernel.1, %s1.1, %s2.1), to_apply=%scaled_matmul.1
}
"""


def test_attribute_looks_through_a_called_computation():
  comps = gc.parse_module(CALLED_CUDNN)
  rec, = gc.describe(comps, [gc.LayerDims("dense", 256, 256, 256,
                                          weight_param="kernel")],
                     quantized=True, cotangent_params=("ct",))
  assert rec["kernel"] == "cuDNN block-scaled"
  assert rec["role"] == "dense Dgrad"

def test_gemm_peak_by_operand_type_and_arch():
  h200, b200 = gc.TARGETS["h200"], gc.TARGETS["b200"]
  fp8 = _gemm(8, 8, 8)
  assert gc.gemm_peak(fp8, h200) == (h200.fp8, "fp8")
  wide = gc.Gemm(**{**fp8.__dict__, "a": "bf16", "b": "bf16"})
  assert gc.gemm_peak(wide, b200) == (b200.bf16, "bf16")
  f32 = gc.Gemm(**{**fp8.__dict__, "a": "f32", "b": "f32",
                   "precision": "highest,highest"})
  assert gc.gemm_peak(f32, h200)[1] == "fp32"
  fp4 = gc.Gemm(**{**fp8.__dict__, "a": "f4e2m1fn", "b": "f4e2m1fn",
                   "op": "scaled-dot"})
  assert gc.gemm_peak(fp4, b200) == (b200.fp4, "fp4")
  assert gc.gemm_peak(fp4, h200)[0] == h200.bf16
  # E2M1 beside E4M3 runs at the FP8 rate: the FP4 peak needs both E2M1.
  half = gc.Gemm(**{**fp4.__dict__, "b": "f8e4m3fn"})
  assert gc.gemm_peak(half, b200) == (b200.fp8, "fp8")
  mixed = gc.Gemm(**{**fp8.__dict__, "a": "f8e4m3fn->bf16"})
  assert gc.gemm_peak(mixed, h200)[1] == "bf16"


def test_roofline_counts_kernels_and_takes_the_slower_bound():
  comps = gc.parse_module(CUBLAS_F8)
  rf = gc.roofline(comps, gc.TARGETS["h200"])
  assert rf["kernels"] == 4  # quantize, transpose, GEMM, convert
  assert rf["gemm_flops"] == 2 * 256 * 128 * 512
  # Small GEMM: memory bound (its bytes exclude the cuBLAS workspace).
  gemm_bytes = 256 * 512 + 512 * 128 + 4 + 4 + 256 * 128 * 4
  assert rf["gemm_time_us"] == pytest.approx(gemm_bytes / 4.8e12 * 1e6)
  assert rf["time_us"] > rf["gemm_time_us"]


# A delayed role's first-step amax kernel beside a cast kernel: the model
# prices the first as a later step runs it, reading its history only.
FIRST_STEP = """HloModule first
ENTRY %main (h: f32[1024], t: bf16[4096,4096]) -> (u32[1], f8e4m3fn[4096,4096]) {
  %h = f32[1024]{0} parameter(0)
  %t = bf16[4096,4096]{1,0} parameter(1)
  %z = u32[1]{0} constant({0})
  %first = u32[1]{0} custom-call(%h, %z, %t), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(step)/jvp()/jit(cast_transpose)/qlayers_first_amax/pallas_call"}
  %cast = f8e4m3fn[4096,4096]{1,0} custom-call(%first, %h, %t), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(step)/jvp()/jit(cast_transpose)/qlayers_cast_transpose/pallas_call"}
  ROOT %out = (u32[1]{0}, f8e4m3fn[4096,4096]{1,0}) tuple(%first, %cast)
}
"""


def test_the_step_by_kernel_group_adds_up_to_the_model():
  comps = gc.parse_module(FIRST_STEP)
  rf = gc.roofline(comps, gc.TARGETS["h200"])
  groups = rf["groups"]
  assert list(groups) == ["qlayers_cast_transpose", "qlayers_first_amax"]
  assert [g[0] for g in groups.values()] == [1, 1]
  assert sum(g[1] for g in groups.values()) == pytest.approx(rf["time_us"])
  assert sum(g[2] for g in groups.values()) == rf["bytes"]
  gemm = gc.roofline(gc.parse_module(CUBLAS_F8), gc.TARGETS["h200"])
  assert gemm["groups"]["GEMM"][1] == pytest.approx(gemm["gemm_time_us"])
  assert sum(g[0] for g in gemm["groups"].values()) == gemm["kernels"]
  rows = gc.group_rows([{"status": "ok", "recipe": "r",
                         "roofline": rf}], top=1)
  assert rows[0][0] == "qlayers_cast_transpose" and rows[1][0] == "the rest"
  assert rows[1][1].endswith("(1)")
  rec = {"status": "ok", "recipe": "r", "target": "h200", "triton": False,
         "program": "layer", "kernels": "", "compile_s": 0.0,
         "roofline": rf, "xla_cost": {"flops": 0, "bytes": 0}}
  assert "Where the step goes" not in gc.markdown([rec])
  assert "| qlayers_first_amax |" in gc.markdown([rec], by_group=True)


def test_a_first_step_kernel_is_priced_without_its_tensor():
  comps = gc.parse_module(FIRST_STEP)
  top = gc.entry(comps)
  first, cast = top.insts["first"], top.insts["cast"]
  assert gc.first_step_only(first) and not gc.first_step_only(cast)
  assert gc.kernel_bytes(top, first) == 4 + 1024 * 4 + 4  # out, history, word
  assert gc.kernel_bytes(top, cast) == (4096 * 4096 + 4 + 1024 * 4
                                        + 4096 * 4096 * 2)


# A kernel's PTX as XLA:GPU dumps it: one entry, a loop (a branch back to
# an earlier label), integer and float instructions, directives.
PTX = """
.version 8.7
.target sm_100a
.address_size 64

.visible .entry loop_convert_fusion(
	.param .u64 loop_convert_fusion_param_0
)
.reqntid 128, 1, 1
{
	.reg .b32 	%r<9>;
	.reg .f32 	%f<4>;
	.reg .pred 	%p<2>;
	mov.u32 	%r1, %tid.x;
	{ .reg .b32 t; mov.u32 t, 0x0; ld.global.b32 { t }, [ %rd1 + 0 ]; }
$L__BB0_1:
	shf.l.wrap.b32 	%r2, %r1, %r1, 13;
	xor.b32 	%r3, %r2, %r1;
	add.s32 	%r4, %r3, 1;
	mul.rn.f32 	%f1, %f2, %f3;
	setp.lt.u32 	%p1, %r4, 64;
	@%p1 bra 	$L__BB0_1;
	ret;
}
"""

THUNKS = """001: kCustomKernel [source        | next=002 (1)  ] loop_convert_fusion grid: [256, 2, 1] threads: [128, 1, 1]  shared_memory: 0 bytes
002: kCuDnn        [prev=001 (1)  | next=003 (1)  ] kCuDnn
"""

THUNK_METADATA = """thunk_metadata {
  thunk_info {
    profile_annotation: "loop_convert_fusion"
    thunk_id: 1
  }
  thunk_kind: "kCustomKernel"
}
"""


def test_ptx_counts_a_kernels_instructions_and_finds_its_loops():
  total, integer, loops = gc.parse_ptx(PTX)["loop_convert_fusion"]
  # mov, the inline assembly's mov and ld (its .reg declares), shf, xor,
  # add, mul, setp, bra, ret; shf, xor and add are integer.
  assert (total, integer, loops) == (10, 3, True)
  straight = PTX.replace("\t@%p1 bra \t$L__BB0_1;\n", "")
  assert gc.parse_ptx(straight)["loop_convert_fusion"] == (9, 3, False)


def test_issue_roof_charges_a_kernel_its_instructions(tmp_path):
  (tmp_path / "module_0001.jit_step.1.ptx").write_text(PTX)
  (tmp_path / "module_0001.jit_step.thunk_sequence.txt").write_text(THUNKS)
  (tmp_path / "module_0001.jit_step.thunk_metadata.txt").write_text(
      THUNK_METADATA)
  code = gc.kernel_code(tmp_path, count_sass=False)
  assert code == {"loop_convert_fusion": gc.KernelCode(
      "loop_convert_fusion", 256 * 2 * 128, 10, 3, True)}
  h200 = gc.TARGETS["h200"]
  clocks = max(10 / gc.ISSUE_PER_CLOCK, 3 / gc.INTEGER_PER_CLOCK)
  assert gc.issue_s(code["loop_convert_fusion"], h200) == pytest.approx(
      65536 * clocks / (132 * 1.98e9))
  comps = gc.parse_module(CUBLAS_F8)
  plain = gc.roofline(comps, h200)
  assert "issue" not in plain
  # Instructions enough to outlast the quantize fusion's bytes: charged.
  heavy = {"loop_convert_fusion": gc.KernelCode(
      "loop_convert_fusion", 256 * 512, 4000, 0, False)}
  rf = gc.roofline(comps, h200, heavy)
  quant_bytes = 256 * 512 * 2 + 4 + 256 * 512
  extra = (gc.issue_s(heavy["loop_convert_fusion"], h200)
           - quant_bytes / 4.8e12) * 1e6
  assert extra > 0
  assert rf["issue_extra_us"] == pytest.approx(extra)
  assert rf["time_us"] == pytest.approx(plain["time_us"] + extra)
  assert [k["hlo"] for k in rf["issue_bound"]] == ["loop_convert_fusion"]
  # A light kernel stays at its bytes.
  assert gc.roofline(comps, h200, code)["time_us"] == pytest.approx(
      plain["time_us"])


SASS = """
//--------------------- .text.qlayers_cast --------------------------
\t.section\t.text.qlayers_cast,"ax",@progbits
qlayers_cast:
.text.qlayers_cast:
        /*0000*/                   LDC R1, c[0x0][0x37c] ;
        /*0010*/                   S2R R0, SR_TID.X ;
        /*0020*/                   USHF.L.U32 UR8, UR6, 0x5, URZ ;
        /*0030*/                   IMAD.SHL.U32 R2, R0, 0x8, RZ ;
        /*0040*/                   LOP3.LUT R3, R3, 0x18, R2, 0xf8, !PT ;
        /*0050*/                   IADD3 R4, R3, 0x1, RZ ;
        /*0060*/               @!P0 SHF.L.W.U32.HI R5, R4, 0xd, R4 ;
        /*0070*/                   FMUL R6, R5, R5 ;
        /*0080*/                   F2I.U32.TRUNC.NTZ R7, R6 ;
        /*0090*/                   VIADD R8, R7, 0x1 ;
        /*00a0*/                   STG.E desc[UR4][R2.64], R8 ;
        /*00b0*/                   EXIT ;
        /*00c0*/                   BRA 0xc0;
        /*00d0*/                   NOP;
//--------------------- .text.loop_add_fusion --------------------------
.text.loop_add_fusion:
        /*0000*/                   FADD R0, R1, R2 ;
        /*0010*/                   EXIT ;
"""


def test_sass_counts_a_kernels_instructions_by_pipeline():
  counts = gc.parse_sass(SASS)
  # 13 instructions less the NOP; alu: LOP3, IADD3, SHF, VIADD (an opcode
  # no set names is charged to alu); fma: IMAD (heavy) and FMUL; xu: F2I.
  assert counts["qlayers_cast"] == gc.SassCounts(
      total=13, alu=4, fma=2, fma_heavy=1, xu=1)
  assert counts["loop_add_fusion"] == gc.SassCounts(2, 0, 1, 0, 0)
  assert gc.sass_pipe("MUFU") == "xu" and gc.sass_pipe("UIADD3") is None
  assert gc.sass_pipe("F2FP") == "alu" and gc.sass_pipe("LDG") is None
  # The busiest of issue, alu, fma, its heavy half and xu.
  heavy_xu = gc.SassCounts(total=64, alu=10, fma=10, fma_heavy=0, xu=8)
  assert heavy_xu.clocks() == 8 / gc.XU_PER_CLOCK
  alu = gc.SassCounts(total=200, alu=150, fma=40, fma_heavy=40, xu=0)
  assert alu.clocks() == 150 / gc.ALU_PER_CLOCK


def test_issue_roof_takes_the_sass_counts_where_there_are_any():
  h200 = gc.TARGETS["h200"]
  sass = gc.SassCounts(total=1500, alu=700, fma=900, fma_heavy=800, xu=64)
  code = gc.KernelCode("k", 256 * 512, 4000, 2500, False,
                       dataclasses.astuple(sass))
  per_clock = 256 * 512 / (h200.sms * h200.ghz * 1e9)
  assert gc.issue_s(code, h200) == pytest.approx(
      per_clock * 800 / gc.FMA_HEAVY_PER_CLOCK)
  assert gc.issue_s(code, h200, "ptx") == pytest.approx(
      per_clock * 2500 / gc.INTEGER_PER_CLOCK)
  comps = gc.parse_module(CUBLAS_F8)
  rf = gc.roofline(comps, h200, {"loop_convert_fusion": code})
  assert rf["issue_counted"] == {"kernels": 1, "sass": 1}
  quant_s = (256 * 512 * 2 + 4 + 256 * 512) / 4.8e12
  assert rf["issue_extra_us"] == pytest.approx(
      (gc.issue_s(code, h200) - quant_s) * 1e6)
  assert rf["ptx"]["issue_extra_us"] == pytest.approx(
      (gc.issue_s(code, h200, "ptx") - quant_s) * 1e6)
  assert rf["ptx"]["time_us"] - rf["time_us"] == pytest.approx(
      rf["ptx"]["issue_extra_us"] - rf["issue_extra_us"])


def test_describe_marks_emulation_and_records_passes():
  text = CUBLAS_F8.replace('"__cublas$lt$matmul$f8"', '"__cublas$lt$matmul"')
  text = text.replace("f8e4m3fn[256,512]{1,0} fusion(%x.1, %sa.1)",
                      "bf16[256,512]{1,0} fusion(%x.1, %sa.1)")
  text = text.replace("%bitcast.3 = f8e4m3fn", "%bitcast.3 = bf16")
  comps = gc.parse_module(text)
  ly = [gc.LayerDims("dense", 256, 512, 128)]
  rec, = gc.describe(comps, ly, quantized=True)
  assert rec["role"] == "dense Fprop"
  assert rec["kernel"] == "cuBLASLt (emulated: wide operands)"
  assert [p["name"] for p in rec["post"]] == ["loop_convert_fusion.1"]
  rec, = gc.describe(comps, ly, quantized=False)
  assert rec["kernel"] == "cuBLASLt"


def test_first_line_picks_the_compiler_error():
  err = RuntimeError("jaxlib.XlaRuntimeError: some context\n"
                     "INTERNAL: Unsupported instruction opcode: scaled-dot\n"
                     "more")
  assert gc.first_line(err) == \
      "INTERNAL: Unsupported instruction opcode: scaled-dot"


def test_markdown_reports_failures_and_ratios():
  ok = {"target": "h200", "triton": False, "program": "layer",
        "recipe": "bf16", "host_arch": False, "status": "ok",
        "compile_s": 1.0, "kernels": "3 cuBLASLt",
        "gemms": [], "roofline": {"kernels": 3, "gemm_flops": 1e9,
                                  "bytes": 2**20, "time_us": 10.0,
                                  "gemm_time_us": 8.0},
        "xla_cost": {"flops": -1.0, "bytes": -1.0}}
  fast = dict(ok, recipe="fp8_current",
              roofline=dict(ok["roofline"], time_us=5.0))
  bad = dict(ok, recipe="mxfp8", status="failed", gemms=None,
             error="INTERNAL: Unsupported instruction opcode: scaled-dot")
  text = gc.markdown([ok, fast, bad])
  assert "| mxfp8 | failed |" in text
  assert "Unsupported instruction opcode: scaled-dot" in text
  assert "| 2.00x |" in text


def test_dispatch_label_names_the_target_and_the_ffi_library():
  rec = {"target": "h200", "host_arch": False,
         "ffi_targets": {"cuda": ["qlayers_gemm_blockwise"]}}
  assert gc.dispatch_label(rec) == ("dispatch for sm_90, FFI: "
                                    "qlayers_gemm_blockwise")
  assert gc.dispatch_label(dict(rec, ffi_targets={})) == (
      "dispatch for sm_90, no FFI library")
  assert "unknown" in gc.dispatch_label(dict(rec, host_arch=True))
  # Records of the earlier stopgap flag keep their label.
  assert gc.dispatch_label({"assume_gpu_dispatch": True}) == \
      "assumed GPU dispatch"


def test_scaled_outside_sees_a_scale_multiply_after_the_gemm():
  comps = gc.parse_module(CUBLAS_F8)
  comp, g = gc.find_gemms(comps)[0]
  assert gc.scaled_outside(comps, comp, g)
  rec, = gc.describe(comps, [gc.LayerDims("dense", 256, 512, 128)],
                     quantized=True)
  assert rec["folded"] is False
  # The same module with the scale multiply gone from the convert fusion.
  text = CUBLAS_F8.replace(
      "%m.2 = f32[256,128]{1,0} multiply(%p0.2, %b.2)\n"
      "  ROOT %r.2 = bf16[256,128]{1,0} convert(%m.2)",
      "ROOT %r.2 = bf16[256,128]{1,0} convert(%p0.2)")
  comps = gc.parse_module(text)
  comp, g = gc.find_gemms(comps)[0]
  assert not gc.scaled_outside(comps, comp, g)
  # Row-wise scales reach the output as a product of two broadcasts.
  text = CUBLAS_F8.replace(
      "%b.2 = f32[256,128]{1,0} broadcast(%p1.2), dimensions={}",
      "%r.3 = f32[256,128]{1,0} broadcast(%p1.2), dimensions={}\n"
      "  %c.3 = f32[256,128]{1,0} broadcast(%p1.2), dimensions={}\n"
      "  %b.2 = f32[256,128]{1,0} multiply(%r.3, %c.3)")
  comps = gc.parse_module(text)
  comp, g = gc.find_gemms(comps)[0]
  assert gc.scaled_outside(comps, comp, g)
  # A multiply by a broadcast constant is the consumer's (an optimizer's
  # moment decay, the attention's 1/sqrt(d)), not a scale.
  text = CUBLAS_F8.replace(
      "%b.2 = f32[256,128]{1,0} broadcast(%p1.2), dimensions={}",
      "%k.2 = f32[] constant(0.1)\n"
      "  %b.2 = f32[256,128]{1,0} broadcast(%k.2), dimensions={}")
  comps = gc.parse_module(text)
  comp, g = gc.find_gemms(comps)[0]
  assert not gc.scaled_outside(comps, comp, g)
  comps = gc.parse_module(SPLIT_K)
  comp, g = gc.find_gemms(comps)[0]
  assert gc.scaled_outside(comps, comp, g)  # through the split-K reduce


def test_issues_name_what_keeps_a_gemm_from_the_ideal():
  comps = gc.parse_module(CUBLAS_F8)
  rec, = gc.describe(comps, [gc.LayerDims("dense", 256, 512, 128)],
                     quantized=True)
  assert rec["issues"] == ["scale after GEMM", "writes f32",
                           "1 pass in (0 MiB)", "1 pass out (0 MiB)"]
  comps = gc.parse_module(TRITON_F8)
  rec, = gc.describe(comps, [gc.LayerDims("dense", 256, 512, 128)],
                     quantized=True)
  assert rec["role"] == "dense Fprop" and rec["issues"] == []
  # A Wgrad writes FP32 by design; its split-K reduce is an extra pass.
  comps = gc.parse_module(SPLIT_K)
  rec, = gc.describe(comps, [gc.LayerDims("dense", 512, 256, 128)],
                     quantized=True)
  assert rec["role"] == "dense Wgrad"
  assert rec["issues"] == ["scale after GEMM", "1 pass out (1 MiB)"]
  assert gc.issues(dict(rec, role="attention")) == []


MULTI_OUTPUT = """
HloModule jit_step, is_scheduled=true

%fused_two (p0: f32[64,64], p1: f32[64,64]) -> (f32[], f8e5m2[64,64]) {
  %p0 = f32[64,64]{1,0} parameter(0)
  %p1 = f32[64,64]{1,0} parameter(1)
  %c0 = f32[] constant(0)
  %r = f32[] reduce(%p1, %c0), dimensions={0,1}, to_apply=%add
  %q = f8e5m2[64,64]{1,0} convert(%p0)
  ROOT %t = (f32[], f8e5m2[64,64]{1,0}) tuple(%r, %q)
}

ENTRY %main.6 (ct.1: f32[64,64], kernel.1: f32[64,64]) -> f32[] {
  %ct.1 = f32[64,64]{1,0} parameter(0), metadata={op_name="ct"}
  %kernel.1 = f32[64,64]{1,0} parameter(1), metadata={op_name="st['kernel'].value"}
  %fusion.1 = (f32[], f8e5m2[64,64]{1,0}) fusion(%ct.1, %kernel.1), kind=kInput, calls=%fused_two
  %gte.0 = f32[] get-tuple-element(%fusion.1), index=0
  ROOT %gte.1 = f8e5m2[64,64]{1,0} get-tuple-element(%fusion.1), index=1
}
"""


def test_entry_param_cone_follows_one_output_of_a_multi_output_fusion():
  comps = gc.parse_module(MULTI_OUTPUT)
  top = gc.entry(comps)
  assert gc.entry_param_cone(comps, top, "gte.1") == {"ct.1"}
  assert gc.entry_param_cone(comps, top, "gte.0") == {"kernel.1"}
  assert gc.entry_param_cone(comps, top, "fusion.1") == {"ct.1", "kernel.1"}
  assert gc.param_by_op_name(top, "kernel") == "kernel.1"


def test_gpu_check_counts_fp8_by_what_the_mma_reads():
  """benchmarks/gpu.py classifies measured GEMMs with this parser: a Triton
  fusion on FP8 payloads is FP8, one converting them to BF16 is not."""
  import gpu  # pylint: disable=g-import-not-at-top
  cls = gpu.classify(TRITON_F8)
  assert cls["gemms"] == {"Triton [f8e4m3fn x f8e5m2 -> bf16]": 1}
  assert cls["fp8_gemms"] == 1 and cls["model_us"] > 0
  converted = TRITON_F8.replace(
      "%dot.0 = f32[256,128]{1,0} dot(%parameter_0, %parameter_1)",
      "%cv.a = bf16[256,512]{1,0} convert(%parameter_0)\n"
      "  %cv.b = bf16[512,128]{1,0} convert(%parameter_1)\n"
      "  %dot.0 = f32[256,128]{1,0} dot(%cv.a, %cv.b)")
  assert gpu.classify(converted)["fp8_gemms"] == 0
  assert gpu.classify(FFI_BLOCKWISE)["fp8_gemms"] == 1
  assert gpu.classify(CUDNN_MX)["fp8_gemms"] == 1


def test_gpu_report_puts_each_cell_under_its_column():
  """benchmarks/gpu.py's table: an error lands in the status column, a
  measured row shows the model with launches charged."""
  import gpu  # pylint: disable=g-import-not-at-top
  text = gpu.render({"layer": {"error": "boom", "rows": [
      {"item": "fp8", "ms": 1.0, "tflops": 2.0, "model_us": 900.0,
       "meas_over_model": 1.1, "model_launched_us": 1000.0, "ratio": 1.2,
       "target": 1.1, "gemms": {"k": 1}}]}})
  head, _, error, measured = ([c.strip() for c in line.strip("|").split("|")]
                              for line in text.strip().splitlines())
  assert len(error) == len(measured) == len(head)
  assert error[head.index("status")] == "ERROR"
  assert measured[head.index("+launches ms")] == "1.000"
  assert measured[head.index("status")] == "met"


def test_gpu_kernel_check_compares_bits_and_pairs_each_role():
  """benchmarks/gpu.py's kernel check: bits compared with NaNs as one value
  (but -0 against +0, a changed dtype or shape counted); for a Blackwell
  target the mxfp6 layer's three pairs are its kernel's, and for Hopper
  the mxfp8 pairs carry the layer's dequantized copies."""
  import gpu  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import ml_dtypes  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import qlayers  # pylint: disable=g-import-not-at-top
  a = np.array([1.0, np.nan, 0.0, 2.0], np.float32)
  assert gpu._bit_mismatches(a, a.copy()) == 0  # pylint: disable=protected-access
  b = a.copy()
  b[1] = -np.nan
  b[2] = -0.0
  assert gpu._bit_mismatches(a, b) == 1  # pylint: disable=protected-access
  e4m3 = a.astype(ml_dtypes.float8_e4m3fn)
  assert gpu._bit_mismatches(e4m3, e4m3.copy()) == 0  # pylint: disable=protected-access
  assert gpu._bit_mismatches(e4m3, a) == 4  # pylint: disable=protected-access
  with qlayers.table.target_arch("sm_100"):
    cases = gpu._kernel_cases("mxfp6", (128, 64, 96))  # pylint: disable=protected-access
    assert [c[0] for c in cases] == ["x", "w", "g"]
    assert all(qlayers.operands.pairable(jnp.asarray(t), last, first)
               for _, t, last, first, _, _ in cases)
    assert not any(any(c[5]["dequantized"]) for c in cases)
  with qlayers.table.target_arch("sm_90"):  # MX emulated: as the layer makes
    cases = gpu._kernel_cases("mxfp8", (128, 64, 96))  # pylint: disable=protected-access
    assert [c[5]["dequantized"] for c in cases] == [
        (True, False), (False, True), (True, True)]


def test_compare_puts_runs_side_by_side():
  gemm = {"role": "dense Fprop", "issues": ["emulated", "writes f32"]}
  def rec(recipe, time_us, kernels, gemms=(), status="ok"):
    return {"target": "h200", "triton": True, "program": "layer",
            "recipe": recipe, "status": status, "kernels": kernels,
            "gemms": list(gemms), "error": "INTERNAL: boom",
            "roofline": {"time_us": time_us}}
  before = [rec("bf16", 10.0, "3 Triton"),
            rec("mxfp8", 20.0, "3 Triton (emulated: wide operands)",
                [gemm, gemm])]
  after = [rec("bf16", 10.0, "3 Triton"),
           rec("mxfp8", 5.0, "3 cuDNN block-scaled", status="failed")]
  text = gc.compare_markdown([("before", before), ("after", after)])
  assert "#### h200 (sm_90), Triton GEMMs on, layer" in text
  assert ("| mxfp8 | 3 Triton (emulated: wide operands) | emulated x2; "
          "writes f32 x2 | 0.50x | failed | INTERNAL: boom | |") in text
  assert "| bf16 | 3 Triton | - | 1.00x | 3 Triton | - | 1.00x |" in text



def test_compare_gemms_puts_each_layer_gemm_side_by_side():
  def g(role, kernel, out, folded, post=()):
    return {"role": role, "kernel": kernel, "a": "f8e4m3fn",
            "b": "f8e4m3fn", "out": out, "folded": folded,
            "scales": "a:f32[] b:const 1" if folded else "a:const 1 b:const 1",
            "pre": [], "post": list(post), "issues": []}
  def rec(gemms, program="layer", status="ok"):
    return {"target": "h200", "triton": False, "program": program,
            "recipe": "fp8_current", "status": status, "gemms": gemms,
            "error": "INTERNAL: boom"}
  pass_out = {"what": "convert fusion", "nbytes": 96 * 2**20}
  before = [rec([g("dense Wgrad", "cuBLASLt FP8", "f32", False),
                 g("dense Fprop", "cuBLASLt FP8", "f32", False, [pass_out])]),
            rec([g("q+k+v Fprop", "Triton", "bf16", True)], program="block")]
  after = [rec([g("dense Fprop", "cuBLASLt FP8", "bf16", True),
                g("dense Wgrad", "cuBLASLt FP8", "f32", True)])]
  text = gc.compare_gemms_markdown([("before", before), ("after", after)])
  assert "#### h200 (sm_90), Triton GEMMs off, layer: per GEMM" in text
  lines = [l for l in text.splitlines() if l.startswith("| fp8_current")]
  # Fprop before Wgrad whatever order the records list them in; the block
  # program's GEMMs are not in the layer table.
  assert lines == [
      "| fp8_current | dense Fprop | cuBLASLt FP8 | f8e4m3fn x f8e4m3fn -> "
      "f32 | no (a:const 1 b:const 1) | out: convert fusion 96.0 MiB | "
      "cuBLASLt FP8 | f8e4m3fn x f8e4m3fn -> bf16 | yes (a:f32[] b:const 1)"
      " | - |",
      "| fp8_current | dense Wgrad | cuBLASLt FP8 | f8e4m3fn x f8e4m3fn -> "
      "f32 | no (a:const 1 b:const 1) | - | cuBLASLt FP8 | f8e4m3fn x "
      "f8e4m3fn -> f32 | yes (a:f32[] b:const 1) | - |"]
  failed = gc.compare_gemms_markdown([("after", [rec([], status="failed")])])
  assert "| fp8_current | - | failed | INTERNAL: boom | | |" in failed

def test_reparse_reads_kept_hlo_with_the_current_parser(tmp_path):
  rec = {"target": "h200", "triton": True, "program": "layer",
         "recipe": "deepseek_v3", "status": "ok",
         "layer": {"tokens": 256, "k": 512, "n": 128},
         "gemms": [], "kernels": "stale"}
  (tmp_path / "h200_triton_layer_deepseek_v3.hlo").write_text(FFI_BLOCKWISE)
  missing = dict(rec, recipe="mxfp8")  # no HLO kept: left as it was
  out = gc.reparse([rec, missing], str(tmp_path))
  assert out[0]["kernels"] == "1 qlayers FFI FP8 blockwise"
  assert out[0]["gemms"][0]["role"] == "dense Fprop"
  assert out[0]["roofline"]["gemm_flops"] == 2.0 * 256 * 128 * 512
  assert out[1] == missing


# cuDNN fused attention (jax.nn.dot_product_attention, implementation
# "cudnn"), forward and backward, causal: b 1, h 8, s 4096, head 128.
FMHA = """
HloModule jit_f, is_scheduled=true

ENTRY %main (q: bf16[1,4096,8,128], k: bf16[1,4096,2,128]) -> bf16[1,8,4096,128] {
  %q.1 = bf16[1,4096,8,128]{3,2,1,0} parameter(0), metadata={op_name="q"}
  %k.1 = bf16[1,4096,2,128]{3,2,1,0} parameter(1), metadata={op_name="k"}
  %fwd = (bf16[1,8,4096,128]{3,1,2,0}, f32[1,8,4096]{2,1,0}, u8[0]{0}) custom-call(%q.1, %k.1, %k.1), custom_call_target="__cudnn$fmhaSoftmax", backend_config={"cudnn_fmha_backend_config": {"intermediate_tensor_shape": {"element_type": "BF16", "dimensions": ["1", "8", "4096", "4096"]}, "mask_type": "CAUSAL"}}
  %o = bf16[1,8,4096,128]{3,1,2,0} get-tuple-element(%fwd), index=0
  %bwd = (bf16[1,8,4096,128]{3,1,2,0}, u8[0]{0}) custom-call(%q.1, %k.1, %k.1, %o), custom_call_target="__cudnn$fmhaSoftmaxBackward", backend_config={"cudnn_fmha_backend_config": {"intermediate_tensor_shape": {"element_type": "BF16", "dimensions": ["1", "8", "4096", "4096"]}, "mask_type": "NO_MASK"}}
  ROOT %r = bf16[1,8,4096,128]{3,1,2,0} get-tuple-element(%bwd), index=0
}
"""


def test_fused_attention_is_costed_by_its_flops():
  comps = gc.parse_module(FMHA)
  top = gc.entry(comps)
  scores = 1 * 8 * 4096 * 4096
  assert gc.attention_flops(top, top.insts["fwd"]) == 4 * scores * 128 * 0.5
  assert gc.attention_flops(top, top.insts["bwd"]) == 10 * scores * 128
  assert gc.attention_flops(top, top.insts["o"]) == 0.0
  b200 = gc.TARGETS["b200"]
  rf = gc.roofline(comps, b200)
  assert rf["attention_flops"] == 12 * scores * 128
  assert rf["attention_time_us"] == pytest.approx(
      12 * scores * 128 / (b200.bf16 * 1e12) * 1e6)
  assert rf["gemm_flops"] == 0


def test_format_peak_by_element_width():
  h200, b200 = gc.TARGETS["h200"], gc.TARGETS["b200"]
  assert gc.format_peak(["e4m3", "e5m2"], h200) == (h200.fp8, "fp8")
  assert gc.format_peak(["e2m1", "e2m1"], b200) == (b200.fp4, "fp4")
  assert gc.format_peak(["e2m1", "e2m1"], h200) == (h200.fp8, "fp8")
  assert gc.format_peak(["e3m2", "e2m1"], b200) == (b200.fp8, "fp8")
  assert gc.format_peak([None, "e4m3"], b200) == (b200.bf16, "bf16")


def _timed(role, m, n, k, time_us, out="bf16"):
  return {"role": role, "dims": {"batch": 1, "m": m, "n": n, "k": k},
          "out": out, "time_us": time_us, "kernel": "cuBLASLt", "a": "bf16",
          "b": "bf16", "folded": None, "scales": "-", "pre": [], "post": []}


def test_ideal_puts_each_quantized_gemm_at_its_format_peak():
  h200 = gc.TARGETS["h200"]
  m = n = k = 8192
  flops = 2.0 * m * n * k
  bf16_us = flops / (h200.bf16 * 1e12) * 1e6
  base = {"target": "h200", "recipe": "bf16", "status": "ok",
          "roofline": {"time_us": 3 * bf16_us + 100.0},
          "gemms": [_timed("dense Fprop", m, n, k, bf16_us),
                    _timed("dense Dgrad", m, n, k, bf16_us),
                    _timed("attention", m, n, k, bf16_us)]}
  fp8 = ["e4m3", "e4m3"]
  formats = {"Fprop": fp8, "Dgrad": ["e5m2", "e4m3"], "Wgrad": fp8}
  fp8_us = flops / (h200.fp8 * 1e12) * 1e6
  ideal = gc.ideal_time_us(base, formats, h200)
  # Fprop and Dgrad at the FP8 peak; attention and the rest unchanged.
  assert ideal == pytest.approx(2 * fp8_us + bf16_us + 100.0)
  wide = {"Fprop": [None, None], "Dgrad": [None, None], "Wgrad": [None, None]}
  assert gc.ideal_time_us(base, wide, h200) == pytest.approx(
      base["roofline"]["time_us"])
  rec = {"target": "h200", "recipe": "fp8_current", "status": "ok",
         "formats": formats, "roofline": {"time_us": 2 * ideal}}
  got = gc.against_ideal(rec, base)
  assert got["of_ideal"] == pytest.approx(0.5)
  assert got["ideal_speedup"] == pytest.approx(
      base["roofline"]["time_us"] / ideal)
  assert got["speedup"] == pytest.approx(got["ideal_speedup"] / 2)
  assert "launched" not in got  # neither record counts its kernels
  # Records from before per-GEMM times: no ideal rather than a wrong one.
  old = dict(base, gemms=[{k: v for k, v in g.items() if k != "time_us"}
                          for g in base["gemms"]])
  assert gc.against_ideal(rec, old) is None


def test_launch_charged_figures_add_a_microsecond_per_kernel():
  """XLA:GPU's cost model charges each kernel 1 us: a recipe of 100 kernels
  more than BF16's pays 100 us, and its ideal launches BF16's kernels."""
  h200 = gc.TARGETS["h200"]
  base = {"target": "h200", "recipe": "bf16", "status": "ok",
          "gemms": [_timed("dense Fprop", 8192, 8192, 8192, 1000.0)],
          "roofline": {"time_us": 1500.0, "kernels": 50}}
  rec = {"target": "h200", "recipe": "fp8_current", "status": "ok",
         "formats": {"Fprop": ["e4m3", "e4m3"]},
         "roofline": {"time_us": 1200.0, "kernels": 150}}
  assert gc.LAUNCH_US == 1.0
  assert gc.launched_us(1200.0, 150) == 1350.0
  ideal = gc.ideal_time_us(base, rec["formats"], h200)
  got = gc.against_ideal(rec, base)["launched"]
  assert got["speedup"] == pytest.approx(1550.0 / 1350.0)
  assert got["of_ideal"] == pytest.approx((ideal + 50.0) / 1350.0)
  assert got["ideal_speedup"] == pytest.approx(1550.0 / (ideal + 50.0))


def test_markdown_shows_ideal_and_fraction():
  base = {"target": "b200", "triton": False, "program": "llama3-8b",
          "recipe": "bf16", "status": "ok", "compile_s": 1.0,
          "kernels": "1 cuBLASLt", "xla_cost": {"flops": -1.0, "bytes": -1.0},
          "gemms": [_timed("dense Fprop", 4096, 4096, 4096, 8.0)],
          "roofline": {"kernels": 2, "gemm_flops": 1e9, "bytes": 2**20,
                       "time_us": 10.0, "gemm_time_us": 8.0}}
  b200 = gc.TARGETS["b200"]
  fp8_us = 2.0 * 4096**3 / (b200.fp8 * 1e12) * 1e6
  q = dict(base, recipe="mxfp8", formats={"Fprop": ["e4m3", "e4m3"]},
           roofline=dict(base["roofline"], time_us=2 * (2.0 + fp8_us)))
  text = gc.markdown([base, q])
  ideal = 2.0 + fp8_us  # compute bound at 4096^3
  assert f"| {10.0 / ideal:.2f}x | 0.50 |" in text
  # Both launch two kernels: +2 us each, the ideal too.
  assert (f"| {12.0 / (2 * ideal + 2):.2f}x | {(ideal + 2) / (2 * ideal + 2):.2f} |"
          in text)


def test_compile_cpu_time_counts_child_processes():
  # XLA:GPU runs ptxas as a child process: benchmarks/compile.py's CPU time
  # must include it, or a GPU-target compile looks cheaper than it is.
  import subprocess  # pylint: disable=g-import-not-at-top
  import compile as cb  # noqa: E402  (benchmarks/compile.py)
  spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass"
  _, wall, cpu = cb._timed(lambda: subprocess.run([sys.executable, "-c", spin],
                                                  check=True))
  assert cpu >= 0.3 and wall >= 0.3


def test_compile_cpus_pins_the_isolated_variant(monkeypatch):
  """``--cpus`` runs each isolated variant's process on those CPUs only:
  the child (here a stand-in for ``compile.py measure``) sees that
  affinity. Bad lists are refused by the parser."""
  import argparse  # pylint: disable=g-import-not-at-top
  import json  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import compile as cb  # noqa: E402  (benchmarks/compile.py)
  real_run = subprocess.run
  report = (f"import os, json; print({cb._RESULT!r} + json.dumps("
            "{'cpus': sorted(os.sched_getaffinity(0))}))")
  monkeypatch.setattr(cb.subprocess, "run", lambda cmd, **kw: real_run(
      [sys.executable, "-c", report], **kw))
  before = os.sched_getaffinity(0)
  one = min(before)
  pinned = cb._measure_isolated("gpt-d64", "stock", blocks=1, rules="all",
                                timeout=60, cpus=frozenset({one}))
  assert pinned["cpus"] == [one]
  assert os.sched_getaffinity(0) == before  # this process is not pinned
  free = cb._measure_isolated("gpt-d64", "stock", blocks=1, rules="all",
                              timeout=60)
  assert free["cpus"] == sorted(os.sched_getaffinity(0))
  assert cb._cpu_set("1,0") == frozenset({0, 1})
  for bad in ("", "a", "-1", "1,,2"):
    with pytest.raises(argparse.ArgumentTypeError):
      cb._cpu_set(bad)


def test_compile_unchecked_variant_drops_only_the_finiteness_check():
  """``qlayers-unchecked/R`` is ``qlayers/R`` with the optimizer's
  ``skip_nonfinite`` off, so their difference is the check's cost."""
  import compile as cb  # noqa: E402  (benchmarks/compile.py)
  from qlayers import optim_wrappers  # pylint: disable=g-import-not-at-top
  opts = {v: cb.build_parts("gpt-d64", v, blocks=1).opt
          for v in ("qlayers/fp8_current", "qlayers-unchecked/fp8_current")}
  checked, unchecked = (dict(o.wrapping) for o in opts.values())
  assert checked.pop("skip_nonfinite") and not unchecked.pop("skip_nonfinite")
  assert checked == unchecked
  skips = [optim_wrappers.find_state(o.opt_state, optim_wrappers.SkipState)
           for o in opts.values()]
  assert skips[0] is not None and skips[1] is None
  with pytest.raises(ValueError, match="take a recipe"):
    cb._parse_variant("qlayers-unchecked")


def test_block_presets_are_llama_shapes_with_gqa():
  p8, p70 = gc.BLOCK_PRESETS["llama3-8b"], gc.BLOCK_PRESETS["llama2-70b"]
  assert (p8["d"], p8["heads"], p8["kv_heads"], p8["ff"]) == (4096, 32, 8,
                                                             14336)
  assert (p70["d"], p70["heads"], p70["kv_heads"], p70["ff"]) == (8192, 64, 8,
                                                                 28672)
  assert p8["attention"] == p70["attention"] == "cudnn"
  _, (state, x, _), layers, _ = gc.block_program(
      "bf16", batch=1, seq=8, d=64, heads=4, kv_heads=2, ff=96)
  dims = {ly.name: (ly.tokens, ly.k, ly.n) for ly in layers}
  assert dims["k"] == dims["v"] == (8, 64, 32)  # 2 KV heads of 16
  assert dims["q"] == dims["o"] == (8, 64, 64)
  assert state[0]["k"]["kernel"].shape == (64, 32) and x.shape == (1, 8, 64)
  with pytest.raises(ValueError, match="multiple of kv_heads"):
    gc.block_program("bf16", batch=1, seq=8, d=64, heads=4, kv_heads=3, ff=96)


def test_recipe_files_are_taken_and_named_by_their_stem(tmp_path):
  """``--recipes`` takes a recipe .toml beside the names; its optimized HLO
  is kept under the file's stem. An unknown name still stops the run."""
  toml = tmp_path / "fp8_current_bf16_wgrad.toml"
  toml.write_text("[fprop]\nx = {}\n")
  item = {"hlo_dir": str(tmp_path), "target": "h200", "triton": False,
          "program": "layer", "recipe": str(toml)}
  assert gc.hlo_path(item).name == "h200_notriton_layer_fp8_current_bf16_wgrad.hlo"
  # Past the recipe check, the run stops at the missing target config.
  with pytest.raises(SystemExit, match="not found; pass --targets-dir"):
    gc.main(["--recipes", f"bf16,{toml}", "--targets", "h200",
             "--targets-dir", str(tmp_path)])
  with pytest.raises(SystemExit, match="unknown recipe"):
    gc.main(["--recipes", f"bf16,{tmp_path / 'missing.toml'}",
             "--targets", "h200", "--targets-dir", str(tmp_path)])


TARGET_TAIL = """gpu_device_info {
  name: "NVIDIA B200"
  runtime_version: "12.8.0"
  dnn_version: "9.10.0"
  cub_version: "3.1.2"
}
platform_name: "CUDA"
dnn_version_info {
  major: 10
  minor: 10
  patch: 0
}
device_description_str: "NVIDIA B200"
"""


def test_target_config_sets_both_cudnn_versions_to_the_installed_one(
    tmp_path, monkeypatch):
  """Both cuDNN fields of a target file become the installed cuDNN's (what
  a GPU running this environment reports); nothing else changes. Without a
  cuDNN wheel the file is read as it is; a file without the two fields is
  refused rather than compiled for an unknown cuDNN."""
  (tmp_path / "b.txtpb").write_text(TARGET_TAIL)
  target = gc.Target("b", "b.txtpb", "sm_100", bf16=1.0, fp8=1.0, fp4=1.0,
                     tf32=1.0, fp32=1.0, tbps=1.0, source="test")
  monkeypatch.setattr(gc, "installed_cudnn", lambda: (9, 28, 1))
  text = gc.target_config(target, tmp_path)
  assert 'dnn_version: "9.28.1"' in text
  assert "dnn_version_info {\n  major: 9\n  minor: 28\n  patch: 1\n}" in text
  assert text.replace('"9.28.1"', '"9.10.0"').replace(
      "major: 9\n  minor: 28\n  patch: 1",
      "major: 10\n  minor: 10\n  patch: 0") == TARGET_TAIL
  monkeypatch.setattr(gc, "installed_cudnn", lambda: None)
  assert gc.target_config(target, tmp_path) == TARGET_TAIL
  (tmp_path / "b.txtpb").write_text('dnn_version: "9.10.0"\n')
  monkeypatch.setattr(gc, "installed_cudnn", lambda: (9, 28, 1))
  with pytest.raises(ValueError, match="one dnn_version and one"):
    gc.target_config(target, tmp_path)


def test_mesh_link_time_is_each_ring_s_traffic_at_the_link_rate():
  """`gpu_mesh.link_us`: an all-gather of S over n devices sends S (n-1)/n
  per device, a reduce-scatter returning S/n the same, an all-reduce twice
  that; at 450 GB/s each way (H200's NVLink)."""
  import gpu_mesh  # pylint: disable=g-import-not-at-top
  h200 = gc.TARGETS["h200"]
  assert h200.link_gbps == 450.0 and gc.TARGETS["b200"].link_gbps == 900.0
  one = 450e9 / 2**20 * 1e-6  # MiB sent in one microsecond
  assert gpu_mesh.link_us({"all-gather": 8 * one}, 8, h200) == pytest.approx(7)
  assert gpu_mesh.link_us({"reduce-scatter": one}, 8, h200) == pytest.approx(7)
  assert gpu_mesh.link_us({"all-reduce": 8 * one, "all-gather": 0.0}, 8,
                          h200) == pytest.approx(14)
  assert gpu_mesh.link_us({}, 8, h200) == 0


def test_an_interrupted_run_stops_its_worker(tmp_path, monkeypatch):
  """A run stopped while its worker compiles (Ctrl-C here; SIGTERM, which
  the script turns into an exit, takes the same way out) kills the worker
  instead of leaving it to compile on until its timeout."""
  import os  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top
  pid_file = tmp_path / "worker.pid"
  worker = tmp_path / "python"  # stands in for the worker's interpreter
  worker.write_text(f"#!/bin/sh\necho $$ > {pid_file}\nexec sleep 60\n")
  worker.chmod(0o755)

  class Interrupted(subprocess.Popen):
    """The worker, real; the wait for it interrupted once it has started."""

    def communicate(self, *args, timeout=None, **kw):
      if timeout is not None:  # run_items' wait, not its clean-up
        deadline = time.monotonic() + 30
        while not pid_file.exists() or not pid_file.read_text().strip():
          assert time.monotonic() < deadline, "the worker did not start"
          time.sleep(0.01)
        raise KeyboardInterrupt
      return super().communicate(*args, **kw)

  monkeypatch.setattr(gc.subprocess, "Popen", Interrupted)
  with pytest.raises(KeyboardInterrupt):
    gc.run_items([{"recipe": "bf16"}], str(worker), timeout=60)
  with pytest.raises(ProcessLookupError):
    os.kill(int(pid_file.read_text()), 0)  # gone (reaped), not sleeping on


def test_compile_breakdown_traces_its_parts_for_the_target_it_is_given():
  """``compile.py breakdown --target`` compiles each part as ``measure``
  does: inputs placed on the target's device, GEMMs chosen for its arch."""
  import jax  # noqa: E402
  import jax.numpy as jnp  # noqa: E402
  import compile as cb  # noqa: E402  (benchmarks/compile.py)
  import compile_breakdown as bd  # noqa: E402  (benchmarks/)
  from qlayers import table  # noqa: E402
  seen = []

  def fn(x):
    seen.append(table.gpu_arch("cuda"))
    return x * 2

  x = jnp.ones((4, 8), jnp.float32)
  cpu = jax.devices("cpu")[0]
  here = bd.Part("g", "host", fn, x, where=cb.Where())
  there = bd.Part("g", "target", fn, x, where=cb.Where(cpu, "sm_100"))
  assert seen == [None, "sm_100"]
  assert here.hlo > 0 and there.hlo > 0
  placed, = cb.Where(cpu, "sm_100").place((x,))
  assert isinstance(placed, jax.ShapeDtypeStruct)
  assert placed.sharding == jax.sharding.SingleDeviceSharding(cpu)
  assert cb.Where().place((x,))[0] is x
  assert cb.Where.of("cpu") == cb.Where()
