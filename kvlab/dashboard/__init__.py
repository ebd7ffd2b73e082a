"""What the dashboard needs beyond the kvlab library: run data shaped for drawing, and a few shared page helpers.

The pages in ``views/`` hold layout and widgets only. Everything they show is computed here:

* :mod:`kvlab.runs.live`: a live run as data (the prompt, the settings, the trace of its events);
* :mod:`kvlab.runs.live_store` and :mod:`kvlab.runs.replay`: a finished live run stored with its replay, and replays
  packed, unpacked and scrubbed without a model;
* :mod:`kvlab.dashboard.live_figures`, :mod:`kvlab.dashboard.store_figures`, :mod:`kvlab.dashboard.grid_figures` and
  :mod:`kvlab.dashboard.cost_view`: pure functions from that data, or from stored runs, to plotly figures with bounded
  point counts, each with its :class:`~kvlab.dashboard.guides.ChartGuide`; bytes in binary units (:mod:`kvlab.units`);
* :mod:`kvlab.dashboard.report`: a comparison as one self-contained HTML file;
* :mod:`kvlab.runs.tables`: pure functions from stored runs to the tables the pages show;
* :mod:`kvlab.dashboard.inputs`: widget values turned into kvlab objects, with every mistake one sentence;
* :mod:`kvlab.dashboard.grid`: the needle grid the page asks for, as a storable request, run into the store;
* :mod:`kvlab.dashboard.sweep_jobs`: needle grids running in the server's background, visible to every session,
  resumable;
* :mod:`kvlab.dashboard.downloads`: stored runs and trials as CSV or Parquet bytes;
* :mod:`kvlab.runs.device_queue`: the process-wide queue that lets one session at a time use the device;
* :mod:`kvlab.dashboard.access`: who may use the server (login or localhost) and which models it may load;
* :mod:`kvlab.dashboard.session`: the Streamlit side shared by all pages (login, model picker, store, waiting notices);
* :mod:`kvlab.dashboard.chart_view` and :mod:`kvlab.dashboard.live_view`: the Streamlit side of charts (drawn with their
  guide and image download) and of a live run's charts;
* :mod:`kvlab.dashboard.text`: user text shown as plain text inside Streamlit's Markdown.
"""
