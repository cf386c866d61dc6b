"""Everything pearlctl says to Slurm goes through this package (docs/architecture.md).

``client.SlurmClient`` runs the commands, ``parse`` reads their output, ``records`` maps job states,
``script`` renders sbatch scripts. Nothing outside this package runs a Slurm command.
"""
