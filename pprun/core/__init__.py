"""Engine-side core: scheduler, KV-cache block manager and the SchedulerOutput seam (no torch)."""
