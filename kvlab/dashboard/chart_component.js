// kvlab's charts: Plotly figures drawn with kvlab's bundle of plotly.js (scatter, bar and heatmap traces,
// static/plotly-kvlab-*.min.js), which a browser runs in about a sixth of the full bundle's time, in
// Streamlit's chart theme.
//
// kvlab.dashboard.chart_view runs this script from the sidebar and again before every chart, with the bundle's
// address in ``data-bundle``: its first run in a page starts loading the bundle, any later one returns at once.
// Each chart is a ``div`` followed by a script that pushes it onto ``window.kvlabCharts`` with its figure and
// configuration (``chart_html``); a chart that arrives before this script has run waits in that list. Both reach
// the page as soon as Streamlit receives them, while the page's script still runs.
(() => {
  if (window.kvlabCharts && !Array.isArray(window.kvlabCharts)) return; // this page already runs it
  const bundle = document.currentScript.dataset.bundle;

  // Streamlit's chart colours (its frontend's defaults), for a light and a dark background. Streamlit's Plotly
  // template (streamlit.elements.lib.streamlit_plotly_theme) colours every figure with placeholders, #000001 to
  // #000040, that its own chart element replaces with these; so does this.
  const PALETTES = {
    light: {
      categorical: ["#0068c9", "#83c9ff", "#ff2b2b", "#ffabab", "#29b09d", "#7defa1", "#ff8700", "#ffd16a", "#6d3fc0", "#d5dae5"],
      sequential: ["#e4f5ff", "#c7ebff", "#a6dcff", "#83c9ff", "#60b4ff", "#3d9df3", "#1c83e1", "#0068c9", "#0054a3", "#004280"],
    },
    dark: {
      categorical: ["#83c9ff", "#0068c9", "#ffabab", "#ff2b2b", "#7defa1", "#29b09d", "#ffd16a", "#ff8700", "#6d3fc0", "#d5dae5"],
      sequential: ["#004280", "#0054a3", "#0068c9", "#1c83e1", "#3d9df3", "#60b4ff", "#83c9ff", "#a6dcff", "#c7ebff", "#e4f5ff"],
    },
  };
  const DIVERGING = ["#7d353b", "#bd4043", "#ff4b4b", "#ff8c8c", "#ffc7c7", "#a6dcff", "#60b4ff", "#1c83e1", "#0054a3", "#004280"];

  // The page's colours and font, as Streamlit's theme set them on the app.
  function theme(element) {
    const app = document.querySelector(".stApp") || document.body;
    const background = getComputedStyle(app).backgroundColor;
    const channels = (background.match(/[\d.]+/g) || ["255", "255", "255"]).map(Number);
    const light = (0.299 * channels[0] + 0.587 * channels[1] + 0.114 * channels[2]) / 255 > 0.5;
    const style = getComputedStyle(element);
    return {
      palette: PALETTES[light ? "light" : "dark"],
      text: style.color,
      font: style.fontFamily,
      background,
      grid: light ? "rgba(49, 51, 63, 0.1)" : "rgba(250, 250, 250, 0.1)",
    };
  }

  // The figure with the placeholders of Streamlit's template (#000001 to #000040) replaced by the theme's colours, in
  // one pass over its JSON.
  function themed(figure, colours) {
    const { categorical, sequential } = colours.palette;
    const singles = { 32: "#29b09d", 33: "#ff2b2b", 34: "#0068c9", 36: colours.text, 37: colours.text, 38: colours.background, 39: colours.grid, 40: colours.background };
    const colour = (number) =>
      number <= 10 ? categorical[number - 1] : number <= 20 ? sequential[number - 11] : number <= 30 ? DIVERGING[number - 21] : singles[number];
    const text = JSON.stringify(figure).replace(/"#0000([0-4]\d)"/g, (found, digits) => {
      const replacement = colour(Number(digits));
      return replacement === undefined ? found : JSON.stringify(replacement);
    });
    return JSON.parse(text);
  }

  // The layout Streamlit's chart element puts under a figure's own: the theme's fonts, colours and margins.
  function themeLayout(colours) {
    const { text, grid, background, font } = colours;
    const axisTitle = { font: { color: text, size: 14 } };
    return {
      font: { color: text, family: font, size: 12 },
      title: { font: { family: font, size: 16, color: text }, x: 0, xanchor: "left" },
      legend: { valign: "top", borderwidth: 0, font: { size: 12, color: text }, title: { font: { size: 12, color: text }, side: "top" } },
      paper_bgcolor: background,
      plot_bgcolor: background,
      xaxis: { gridcolor: grid, zerolinecolor: grid, tickcolor: grid, zeroline: false, showgrid: false, automargin: true, tickfont: { color: text, size: 12 }, title: { ...axisTitle, standoff: 20 } },
      yaxis: { gridcolor: grid, zerolinecolor: grid, tickcolor: grid, automargin: true, ticklabelposition: "outside", tickfont: { color: text, size: 12 }, title: { ...axisTitle, standoff: 24 } },
      margin: { pad: 8, r: 0, l: 0 },
      hoverlabel: { bgcolor: background, bordercolor: grid, font: { color: text, family: font, size: 12 } },
    };
  }

  function isObject(value) {
    return typeof value === "object" && value !== null && !Array.isArray(value);
  }

  // ``layout`` over ``defaults``: the figure's own settings win; the axes of every subplot (xaxis2, yaxis3, ...) get
  // their kind's defaults.
  function under(defaults, layout) {
    const merged = { ...layout };
    for (const [key, value] of Object.entries(defaults)) {
      merged[key] = isObject(value) && isObject(layout[key]) ? under(value, layout[key]) : key in layout ? layout[key] : value;
    }
    for (const key of Object.keys(layout)) {
      const kind = key.match(/^([xy]axis)\d+$/);
      if (kind && isObject(layout[key])) merged[key] = under(defaults[kind[1]], layout[key]);
    }
    return merged;
  }

  const plotly = new Promise((resolve, reject) => {
    const script = document.createElement("script");
    script.src = bundle;
    script.onload = () => resolve(window.Plotly);
    script.onerror = () => reject(new Error(`Plotly's script did not load from ${bundle}`));
    document.head.appendChild(script);
  });
  // Each chart follows its element's width (the sidebar opening, the window resized); one that left the page (a
  // newer drawing replaced it) is freed.
  const resized = new ResizeObserver((entries) => {
    for (const { target, contentRect } of entries) {
      if (!target.isConnected) {
        resized.unobserve(target);
        window.Plotly.purge(target);
      } else if (contentRect.width !== target.kvlabWidth) {
        target.kvlabWidth = contentRect.width;
        window.Plotly.Plots.resize(target);
      }
    }
  });

  // The element each chart was last drawn in, by key. Streamlit replaces a chart's HTML when its figure changes (a
  // live run redraws its charts every second); the chart's earlier element, just taken off the page, goes back in
  // the new one's place and is updated in place, which costs Plotly less than drawing it anew.
  const drawn = new Map();

  // Resolves once the browser has painted what was drawn before (at once in a hidden tab, which paints nothing).
  const painted = () =>
    new Promise((resolve) => (document.hidden ? setTimeout(resolve) : requestAnimationFrame(() => setTimeout(resolve))));

  // Charts are drawn one at a time, in the order they arrive, each after the one before it has been painted: charts
  // that arrive together (or while the bundle loads) would otherwise be drawn in one task, and the page's first
  // chart would show only once every one of them is drawn.
  let turn = plotly;

  function draw({ element, chart: { figure, config } }) {
    const earlier = drawn.get(element.dataset.key);
    if (earlier && earlier !== element && !earlier.isConnected) {
      earlier.style.height = element.style.height;
      element.replaceWith(earlier);
      element = earlier;
    }
    drawn.set(element.dataset.key, element);
    const colours = theme(element);
    const { data, layout } = themed(figure, colours);
    const full = under(themeLayout(colours), layout || {});
    const drawing = turn
      .then((Plotly) => Plotly.react(element, data || [], full, config))
      .then(() => {
        element.kvlabWidth = element.getBoundingClientRect().width;
        resized.observe(element);
      })
      .catch((error) => {
        element.textContent = `The chart could not be drawn: ${error.message}.`;
      });
    turn = drawing.then(painted).then(() => plotly);
  }

  const waiting = window.kvlabCharts || [];
  window.kvlabCharts = { push: draw };
  waiting.forEach(draw);
})();
