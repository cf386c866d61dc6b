"""Everything pearlctl says to Slurm goes through this package (docs/architecture.md). Nothing outside it runs
a Slurm command.

- ``client``: ``SlurmClient``, which runs the commands (sbatch, squeue, scontrol, scancel, sinfo);
- ``runner``: the one seam through which pearlctl runs external commands;
- ``parse``: pure parsers of what the commands print;
- ``records``: what pearlctl knows about one Slurm job or array task, and its state mapped;
- ``script``: a pool's sbatch script rendered from a request (pure);
- ``functions``: short Python functions run on a compute node through submitit.
"""
