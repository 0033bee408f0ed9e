"""Run-time pieces of a sharded program: placements, collectives, local ops, losses, checkpoints."""
