"""C++ helpers of the loop IR's activations (``loopir.ACTIVATIONS``) and the exp they use, beside ``prelude``, which
includes them."""

#: ``exp`` of a float, branch-free (range reduction to [-ln 2 / 2, ln 2 / 2], Cephes' degree-6 polynomial, within
#: 2 ulp of ``std::exp``), so that a loop over it vectorizes: ``std::exp`` is a scalar libm call unless the whole
#: unit is built with -ffast-math. -inf gives 0, NaN stays NaN, overflow gives inf.
EXPF = """#include <cstdint>
#include <cmath>
static inline float scorch_expf(float x) {
  const float hi = 88.3762626647949f, lo = -87.3365478515625f;
  const float c = x < lo ? lo : (x > hi ? hi : x);
  const float n = __builtin_floorf(c * 1.44269504088896341f + 0.5f);
  const float r = c - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float scale = __builtin_bit_cast(float, (int32_t)((int32_t)n + 127) << 23);
  float y = (p * r * r + r + 1.0f) * scale;
  y = x < lo ? 0.0f : y;
  y = x > hi ? INFINITY : y;
  return x != x ? x : y;
}
"""

#: the activations of ``loopir.ACTIVATIONS`` on a float, branch-free so that a loop over them vectorizes (as
#: ``scorch_expf``). ``scorch_erff``: a rational function of x^2 on [-4, 4] (XLA's and Eigen's float erf; past 4,
#: erf is +-1 in float32), within 4.2e-7 of erf, where torch's own GELU (Abramowitz-Stegun 7.1.26) is within
#: 1.1e-6. GELU with tanh: 0.5 x (1 + tanh(u)) = x / (1 + exp(-2u)), SiLU: x / (1 + exp(-x)), as Inductor writes
#: it; both -0 for large negative x (exp overflows to inf), NaN stays NaN.
ACTIVATIONS = """#ifndef SCORCH_ACTIVATIONS
#define SCORCH_ACTIVATIONS
static inline float scorch_erff(float x) {
  const float c = x < -4.0f ? -4.0f : (x > 4.0f ? 4.0f : x);
  const float x2 = c * c;
  float p = -2.72614225801306e-10f;
  p = p * x2 + 2.77068142495902e-08f;
  p = p * x2 + -2.10102402082508e-06f;
  p = p * x2 + -5.69250639462346e-05f;
  p = p * x2 + -7.34990630326855e-04f;
  p = p * x2 + -2.95459980854025e-03f;
  p = p * x2 + -1.60960333262415e-02f;
  float q = -1.45660718464996e-05f;
  q = q * x2 + -2.13374055278905e-04f;
  q = q * x2 + -1.68282697438203e-03f;
  q = q * x2 + -7.37332916720468e-03f;
  q = q * x2 + -1.42647390514189e-02f;
  return c * p / q;
}
static inline float scorch_gelu(float x) { return 0.5f * x * (1.0f + scorch_erff(x * 0.70710678118654752f)); }
static inline float scorch_gelu_tanh(float x) {
  const float u = 0.79788456080286536f * (x + 0.044715f * x * x * x);
  return x / (1.0f + scorch_expf(-2.0f * u));
}
static inline float scorch_silu(float x) { return x / (1.0f + scorch_expf(-x)); }
#endif
"""
