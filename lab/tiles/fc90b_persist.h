/* lab: the Hopper backward's d 64 kernels on a persistent grid (needs lab/bwd90/v8_persist_d64.patch applied to
 * src/; lab/bwd90/v8_persist_d64.md) */
#define FC90B_PERSIST 1
