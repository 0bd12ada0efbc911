"""Plumbing shared by the lessons: launcher variables, data, model, metrics, the checkpoint folder, logging.

What each lesson teaches (init_process_group, set_device, the sampler, the DDP or fully_shard wrap,
no_sync, saving on rank 0, the DCP calls) is written out in the lesson scripts themselves; this
package only translates the launcher's environment, handles files and errors, and keeps score.
"""
