"""Offline compile tooling: what do the kernels compile to on a device this host does not have?

No GPU or TPU is needed, only optional installs (`scripts/install_sm90_tools.sh`,
`scripts/install_tpu_tools.sh`); nothing here is imported by `pallas_kernels` itself.
H100 (sm_90a): `sm90` (lowering, XLA's deviceless compile, `ptxas -v`, static facts), `sm90_compat`
(what differs between JAX releases), `sm90_variants` (the kernel variants CI compiles),
`sm90_mosaic` (the Mosaic GPU decode kernel's facts from its lowering).
TPU v5e / v6e: `tpu` (compile with libtpu's topologies, read the module), `tpu_variants`.
"""
