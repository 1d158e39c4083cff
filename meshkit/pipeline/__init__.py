"""Pipeline parallelism: schedules as data (`schedules`) and their checker and simulator (`simulate`)."""
