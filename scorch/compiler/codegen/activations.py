"""C++ helpers of the loop IR's activations (``loopir.ACTIVATIONS``), beside ``prelude``, which includes them."""

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
