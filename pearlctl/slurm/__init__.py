"""Everything pearlctl says to Slurm goes through this package (design.md §6).

``client.SlurmClient`` runs the commands, ``parse`` reads their output, ``records`` maps job states,
``script`` renders sbatch scripts. Nothing outside this package runs a Slurm command.
"""
