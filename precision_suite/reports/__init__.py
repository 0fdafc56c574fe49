"""Drawing what verdicts and datasets hold: the seed figures, drift and history charts, report
folders, the reproductions' claims and notes. Imports numerics, training and verdicts."""
