/* Lab tiles for the Hopper forward (fwd_sm90.h): d 64 with a 192-key tile (fewer turns and barrier waits per
 * key, 176 of 240 registers for S, P and O) and d 256 with a 64-key tile (12 registers fewer than bc 80, 32 KB
 * less ring), each against the shipped table. */
#define FC90_TILE_64 fc90_tile{64, 128, 192, 2}
#define FC90_TILE_256 fc90_tile{256, 128, 64, 2}
