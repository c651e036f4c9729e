/* lab: the Hopper forward's output stored unstaged at every head dim (16 bytes a lane after a quad transpose, as
 * d 256 does), without the per-warp staging through shared memory that d 64 and d 128 take */
#define FC90_O_UNSTAGED 1
