"""What the dashboard needs beyond the kvlab library: run data shaped for drawing, and a few shared page helpers.

The pages in ``pages/`` hold layout and widgets only. Everything they show is computed here:

* :mod:`kvlab.ui.live`: a live run as data (the prompt, the settings, the trace of its events) and its storage;
* :mod:`kvlab.ui.live_figures` and :mod:`kvlab.ui.store_figures`: pure functions from that data, or from stored
  runs, to plotly figures with bounded point counts;
* :mod:`kvlab.ui.tables`: pure functions from stored runs to the tables the pages show;
* :mod:`kvlab.ui.inputs`: widget values turned into kvlab objects, with every mistake one sentence;
* :mod:`kvlab.ui.grid`: the needle grid the page asks for, as a storable request, run into the store;
* :mod:`kvlab.ui.sweep_jobs`: needle grids running in the server's background, visible to every session, resumable;
* :mod:`kvlab.ui.downloads`: stored runs and trials as CSV or Parquet bytes;
* :mod:`kvlab.ui.device_queue`: the process-wide queue that lets one session at a time use the device;
* :mod:`kvlab.ui.access`: who may use the server (login or localhost) and which models it may load;
* :mod:`kvlab.ui.session`: the Streamlit side shared by all pages (login, model picker, store, waiting notices);
* :mod:`kvlab.ui.text`: user text shown as plain text inside Streamlit's Markdown.
"""
