"""Drawing what verdicts and datasets hold: charts, report folders, the reproductions' claims,
figures and notes. Imports numerics, training and verdicts."""
